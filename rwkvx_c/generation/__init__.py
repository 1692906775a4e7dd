"""Generation: how a token is drawn (sampling) and the batched engine that
advances many sequences of one model together (engine), which sampling,
chat, evaluation and rollouts sit on (docs/training.md §Sampling).

    from rwkvx_c.generation import generate, Sampling
    outs = generate(model, ["Once upon", "The sea"], n=4, max_new_tokens=64,
                    sampling=Sampling(temperature=0.8, top_p=0.9), tokenizer=tok)
    outs[0].text, outs[0].token_ids, outs[0].logprobs, outs[0].stop_reason
"""
from rwkvx_c.generation.engine import (
    DEFAULT_BATCH,
    STOP_REASONS,
    Completion,
    Request,
    generate,
    run_requests,
)
from rwkvx_c.generation.sampling import Sampling, sample_rows, sample_token

__all__ = ["generate", "run_requests", "Request", "Completion", "STOP_REASONS", "Sampling",
           "sample_token", "sample_rows", "DEFAULT_BATCH"]
