"""The bottom layer: atomic file replacement and progress display, which
every layer above may use and which import nothing of rwkvx_c."""
