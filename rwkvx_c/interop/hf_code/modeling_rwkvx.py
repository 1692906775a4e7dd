"""RWKV-X for transformers, in plain PyTorch: the model rwkvx_c trains
(docs/maths.md), RWKV-7 blocks and MoBA attention blocks with its chunk
selection, written into every hybrid export folder so that

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

runs it with transformers alone. A forward over T tokens from a cache is
the same computation as the whole sequence at once: an RWKV block carries
its two token-shift rows and its WKV state [H, N, N]; a MoBA block keeps
every earlier key and value (its chunk selection scores chunk means of
keys) and its channel-mix shift row. ``generate`` feeds the prompt once,
then one token per step through the cache.

Parameter names follow the Hugging Face rwkv7 layout for the RWKV blocks
(``model.layers.{i}.attn.r_proj``, ``attn.w_lora.lora.0`` ...); a MoBA
block is ``model.layers.{i}.attn.{q,k,v,o}_proj`` with the same norms and
channel-mix names. The projections are ``nn.Linear``, so PEFT's LoRA
targets them by name."""
from __future__ import annotations

import math
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_rwkvx import RwkvxConfig


def _eps(v: float | None, key: str) -> float:
    """A norm's epsilon from config.json, where rwkvx_c's export writes the model's own."""
    if v is None:
        raise ValueError(f"config.json lacks {key}: write the folder with rwkvx-c export")
    return float(v)

__all__ = ["RwkvxCache", "RwkvxModel", "RwkvxForCausalLM"]

DECAY_SCALE = math.exp(-0.5)   # w = exp(-e^-1/2 sigmoid(...)), RWKV-7's decay range
KEY_NORM_FLOOR = 1e-12         # the per-head key normalisation's floor
QUERY_BLOCK = 256              # MoBA queries scored at once: bounds the [T, S] score matrix

State = tuple[torch.Tensor, ...]


class RwkvxCache:
    """What generation carries between forward calls, per block: an RWKV
    block (time-mix shift [B, C], WKV state [B, H, N, N] in float32,
    channel-mix shift [B, C]); a MoBA block (keys [B, H, S, N], values
    [B, H, S, N], channel-mix shift [B, C]). seen: tokens consumed."""

    def __init__(self, n_layers: int) -> None:
        self.layers: list[State | None] = [None] * n_layers
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.Tensor) -> RwkvxCache:
        self.layers = [None if s is None else tuple(t.index_select(0, beam_idx.to(t.device))
                                                    for t in s) for s in self.layers]
        return self


def _token_shift(x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """prev - x, with prev[t] = x[t-1] and prev[0] = last (docs/maths.md)."""
    return torch.cat([last.unsqueeze(1), x[:, :-1]], dim=1) - x


class LowRank(nn.Module):
    """x -> act(x A) B (+ bias): the time-mix's LoRA-shaped maps."""

    def __init__(self, C: int, D: int, act: nn.Module, bias: bool) -> None:
        super().__init__()
        self.lora = nn.Sequential(nn.Linear(C, D, bias=False), act, nn.Linear(D, C, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lora(x)
        return out


def wkv7(r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
         b: torch.Tensor, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The RWKV-7 recurrence over T tokens, inputs [B, T, H, N], state S
    [B, H, N, N] (value row i, key column j), all float32:
    S <- S diag(w) + v k^T + (S a) b^T;  y = S r."""
    ys = []
    for t in range(r.shape[1]):
        sa = S @ a[:, t, :, :, None]
        S = S * w[:, t, :, None, :] + v[:, t, :, :, None] * k[:, t, :, None, :] \
            + sa * b[:, t, :, None, :]
        ys.append((S @ r[:, t, :, :, None]).squeeze(-1))
    return torch.stack(ys, dim=1), S


class TimeMix(nn.Module):
    """RWKV-7's time-mix (docs/maths.md §Time-mix); layer_id 0 makes the
    value residual's v_first, later blocks blend towards it."""

    def __init__(self, cfg: RwkvxConfig, layer_id: int) -> None:
        super().__init__()
        C, self.H, self.N = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        for c in "rwkvag":
            setattr(self, f"x_{c}", nn.Parameter(torch.zeros(1, 1, C)))
        self.k_k = nn.Parameter(torch.zeros(C))
        self.k_a = nn.Parameter(torch.zeros(C))
        self.r_k = nn.Parameter(torch.zeros(self.H, self.N))
        self.w_lora = LowRank(C, cfg.decay_low_rank_dim, nn.Tanh(), True)
        self.a_lora = LowRank(C, cfg.a_low_rank_dim, nn.Identity(), True)
        self.v_lora = LowRank(C, cfg.v_low_rank_dim, nn.Identity(), True) if layer_id else None
        self.g_lora = LowRank(C, cfg.gate_low_rank_dim, nn.Sigmoid(), False)
        self.r_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(C, C, bias=False) for _ in range(4))
        self.g_norm = nn.GroupNorm(self.H, C, eps=_eps(cfg.group_norm_eps, "group_norm_eps"))

    def forward(self, x: torch.Tensor, last: torch.Tensor, S: torch.Tensor,
                v_first: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        H, N = self.H, self.N
        dx = _token_shift(x, last)
        xr, xw, xk, xv, xa, xg = (x + dx * getattr(self, f"x_{c}") for c in "rwkvag")
        r, k, v = self.r_proj(xr), self.k_proj(xk), self.v_proj(xv)
        w = torch.exp(-DECAY_SCALE * torch.sigmoid(self.w_lora(xw)))
        if self.v_lora is None:
            v_first = v
        else:
            assert v_first is not None
            v = v + (v_first - v) * torch.sigmoid(self.v_lora(xv))
        alpha = torch.sigmoid(self.a_lora(xa))
        g = self.g_lora(xg)
        kk = F.normalize((k * self.k_k).view(B, T, H, N), dim=-1, eps=KEY_NORM_FLOOR)
        k = k * (1 + (alpha - 1) * self.k_a)
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.float().view(B, T, H, N)
        y, S = wkv7(f32(r), f32(w), f32(k), f32(v), -kk.float(), kk.float() * f32(alpha), S)
        z = self.g_norm(y.reshape(B * T, C).to(x.dtype)).view(B, T, C)
        bonus = (r * k * self.r_k.view(C)).view(B, T, H, N).sum(-1, keepdim=True)
        z = z + (bonus * v.view(B, T, H, N)).view(B, T, C)
        return self.o_proj(z * g), S, v_first


class ChannelMix(nn.Module):
    """relu(x_k W_key)^2 W_value with x_k the token-shift lerp."""

    def __init__(self, cfg: RwkvxConfig) -> None:
        super().__init__()
        C = cfg.hidden_size
        self.x_k = nn.Parameter(torch.zeros(C))
        self.key = nn.Linear(C, cfg.intermediate_size, bias=False)
        self.value = nn.Linear(cfg.intermediate_size, C, bias=False)

    def forward(self, x: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        xk = x + _token_shift(x, last) * self.x_k
        out: torch.Tensor = self.value(torch.relu(self.key(xk)) ** 2)
        return out


def moba_attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, start: int, chunk: int,
                top_k: int) -> torch.Tensor:
    """MoBA attention (docs/maths.md §MoBA selection) of queries q [B, H, T, N]
    at positions start .. start+T-1 over keys and values [B, H, S, N] at
    positions 0 .. S-1: each query scores the complete chunks before its own
    by the dot product with their mean key, keeps the top_k highest (all
    when top_k <= 0 or there are no more than top_k; ties to the earlier
    chunk), and attends softly to them and to its own chunk up to itself."""
    B, H, T, N = q.shape
    S = K.shape[2]
    n_full = S // chunk
    dev = q.device
    key_pos = torch.arange(S, device=dev)
    key_chunk = key_pos // chunk
    # in double, as rwkvx_c selects: the choice is a hard one, so its gates keep the
    # precision that makes near-ties come out the same way
    means = K[:, :, :n_full * chunk].reshape(B, H, n_full, chunk, N).double().mean(dim=3)
    scale = 1.0 / math.sqrt(N)
    out = []
    for t0 in range(0, T, QUERY_BLOCK):
        qb = q[:, :, t0:t0 + QUERY_BLOCK]
        pos = start + t0 + torch.arange(qb.shape[2], device=dev)
        own_chunk = pos // chunk
        allowed = (key_chunk[None, :] == own_chunk[:, None]) & (key_pos[None, :] <= pos[:, None])
        allowed = allowed.expand(B, H, -1, -1)
        if n_full:
            cand = torch.arange(n_full, device=dev)[None, :] < own_chunk[:, None]
            keep = cand.expand(B, H, -1, -1)
            if top_k > 0:
                gates = (qb.double() @ means.transpose(-1, -2)).masked_fill(~cand,
                                                                            float("-inf"))
                order = torch.sort(gates, dim=-1, descending=True, stable=True).indices
                rank = torch.empty_like(order)
                rank.scatter_(-1, order, torch.arange(n_full, device=dev).expand_as(order))
                keep = keep & (rank < top_k)
            picked = keep[..., key_chunk.clamp(max=n_full - 1)] & (key_chunk < n_full)
            allowed = allowed | picked
        scores = (qb @ K.transpose(-1, -2)) * scale
        p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out.append(p @ V)
    return torch.cat(out, dim=2)


class MobaAttention(nn.Module):
    """q, k, v projections, MoBA attention (no positional rotation, scale
    1/sqrt(N)) and the output projection."""

    def __init__(self, cfg: RwkvxConfig) -> None:
        super().__init__()
        C = cfg.hidden_size
        self.H, self.N = cfg.num_heads, cfg.head_dim
        self.chunk, self.top_k = cfg.moba_chunk_size, cfg.moba_top_k
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            nn.Linear(C, C, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, K: torch.Tensor, V: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(B, T, self.H, self.N).transpose(1, 2)
        q = heads(self.q_proj(x))
        start = K.shape[2]
        K = torch.cat([K, heads(self.k_proj(x))], dim=2)
        V = torch.cat([V, heads(self.v_proj(x))], dim=2)
        y = moba_attend(q, K, V, start, self.chunk, self.top_k)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, C)), K, V


class Block(nn.Module):
    """x1 = x + Mix(LN1(x)); out = x1 + ChannelMix(LN2(x1)), Mix the
    time-mix (kind "rwkv") or MoBA attention (kind "moba")."""

    def __init__(self, cfg: RwkvxConfig, kind: str, layer_id: int) -> None:
        super().__init__()
        C = cfg.hidden_size
        self.kind = kind
        self.attn_norm = nn.LayerNorm(C, eps=_eps(cfg.norm_eps, "norm_eps"))
        self.attn: nn.Module = TimeMix(cfg, layer_id) if kind == "rwkv" else MobaAttention(cfg)
        self.ffn_norm = nn.LayerNorm(C, eps=_eps(cfg.norm_eps, "norm_eps"))
        self.ffn = ChannelMix(cfg)
        self.cfg = cfg

    def empty_state(self, B: int, like: torch.Tensor) -> State:
        C, H, N = self.cfg.hidden_size, self.cfg.num_heads, self.cfg.head_dim
        row = like.new_zeros(B, C)
        if self.kind == "rwkv":
            return row, like.new_zeros(B, H, N, N, dtype=torch.float32), row
        kv = like.new_zeros(B, H, 0, N)
        return kv, kv, row

    def forward(self, x: torch.Tensor, state: State, v_first: torch.Tensor | None
                ) -> tuple[torch.Tensor, State, torch.Tensor | None]:
        h1 = self.attn_norm(x)
        if self.kind == "rwkv":
            out, S, v_first = self.attn(h1, state[0], state[1], v_first)
            new: tuple[torch.Tensor, ...] = (h1[:, -1], S)
        else:
            out, K, V = self.attn(h1, state[0], state[1])
            new = (K, V)
        x = x + out
        h2 = self.ffn_norm(x)
        x = x + self.ffn(h2, state[2])
        return x, (*new, h2[:, -1]), v_first


class RwkvxPreTrainedModel(PreTrainedModel):
    config_class = RwkvxConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = {"Block"}  # noqa: RUF012 -- the base class types these as sets
    _skip_keys_device_placement = {"past_key_values"}  # noqa: RUF012
    _supports_cache_class = True
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False   # a recurrent state and a key cache, not a transformers KV cache

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """The base class's, refusing (ValueError) weights that leave any
        parameter of the config's model missing: a config.json that does not
        describe its weights (a block too many in block_types) would get
        those parameters freshly initialised, a model that computes nothing
        it was trained to."""
        info_asked = kwargs.pop("output_loading_info", False)
        loaded: Any = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        model, info = loaded
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise ValueError(f"the weights lack {len(missing)} parameters the config describes "
                             f"(the first: {missing[0]}); config.json does not match "
                             "model.safetensors")
        return (model, info) if info_asked else model

    def _init_weights(self, module: nn.Module) -> None:
        """Every parameter of a fresh model, deterministically given torch's
        seed: Linear and Embedding weights N(0, 0.02), norms' weights 1 and
        biases 0, the time-mix's vectors 0 (their construction's values)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm)):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, (TimeMix, ChannelMix, LowRank)):
            for p in module.parameters(recurse=False):
                nn.init.zeros_(p)


class RwkvxModel(RwkvxPreTrainedModel):
    """Embedding (and its LayerNorm when embed_norm), the blocks, the final
    LayerNorm: hidden states [B, T, C]."""

    def __init__(self, config: RwkvxConfig) -> None:
        super().__init__(config)
        C = config.hidden_size
        self.embeddings = nn.Embedding(config.vocab_size, C)
        self.pre_norm = nn.LayerNorm(C, eps=_eps(config.norm_eps, "norm_eps")) \
            if config.embed_norm else None
        ids = []
        n_rwkv = 0
        for kind in config.block_types:
            if kind not in ("rwkv", "moba"):
                raise ValueError(f"layer type {kind!r} is neither 'rwkv' nor 'moba'")
            ids.append(n_rwkv)
            n_rwkv += kind == "rwkv"
        self.layers = nn.ModuleList(Block(config, k, i) for k, i in zip(config.block_types, ids))
        self.norm = nn.LayerNorm(C, eps=_eps(config.norm_eps, "norm_eps"))
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        assert isinstance(value, nn.Embedding)
        self.embeddings = value

    def forward(self, input_ids: torch.Tensor | None = None,
                past_key_values: RwkvxCache | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, **_: Any
                ) -> tuple[torch.Tensor, RwkvxCache | None]:
        if attention_mask is not None and bool((attention_mask[:, 1:] >
                                                attention_mask[:, :-1]).any()):
            raise ValueError("RWKV-X runs a recurrent state: padding may only follow the "
                             "tokens (right padding), never precede them")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = past_key_values if past_key_values is not None else \
            RwkvxCache(len(self.layers)) if use_cache else None
        v_first = None
        for i, module in enumerate(self.layers):
            block = cast(Block, module)
            st = cache.layers[i] if cache is not None else None
            x, new, v_first = block(x, st if st is not None else block.empty_state(x.shape[0], x),
                                    v_first)
            if cache is not None:
                cache.layers[i] = new
        if cache is not None:
            cache.seen += x.shape[1]
        return self.norm(x), cache


class RwkvxForCausalLM(RwkvxPreTrainedModel, GenerationMixin):
    """RwkvxModel and the head: logits [B, T, V]; with labels, the mean
    next-token cross entropy (labels -100 ignored)."""

    def __init__(self, config: RwkvxConfig) -> None:
        super().__init__(config)
        self.model = RwkvxModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        assert isinstance(value, nn.Embedding)
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor,
                                      past_key_values: RwkvxCache | None = None,
                                      attention_mask: torch.Tensor | None = None,
                                      use_cache: bool | None = None, **kwargs: Any
                                      ) -> dict[str, Any]:
        if past_key_values is not None:   # only the tokens the cache has not seen
            seen = past_key_values.get_seq_length()
            input_ids = input_ids[:, seen:] if input_ids.shape[1] > seen else input_ids[:, -1:]
        return {"input_ids": input_ids, "past_key_values": past_key_values,
                "attention_mask": attention_mask, "use_cache": use_cache}

    def _reorder_cache(self, past_key_values: RwkvxCache, beam_idx: torch.Tensor
                       ) -> RwkvxCache:
        return past_key_values.reorder_cache(beam_idx)

    def forward(self, input_ids: torch.Tensor | None = None,
                past_key_values: RwkvxCache | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                logits_to_keep: int = 0, return_dict: bool | None = None, **kwargs: Any
                ) -> CausalLMOutputWithPast:
        h, cache = self.model(input_ids=input_ids, past_key_values=past_key_values,
                              use_cache=use_cache, inputs_embeds=inputs_embeds,
                              attention_mask=attention_mask)
        logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                   labels[:, 1:].reshape(-1), ignore_index=-100)
        # (transformers types past_key_values as its own Cache; this model's is RwkvxCache)
        return CausalLMOutputWithPast(loss=loss, logits=logits,
                                      past_key_values=cache)  # type: ignore[call-arg]
