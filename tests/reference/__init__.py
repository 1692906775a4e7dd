"""NumPy float64 references written straight from docs/maths.md, one module per
concern. They never call rwkvx_c: they are the independent source of truth
every kernel test compares with. Import from the submodules directly
(`from reference.wkv7 import wkv7_forward`)."""
