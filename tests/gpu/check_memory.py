"""GPU check for §9: the memory the course computes is the memory CUDA allocates.

Called from ``tests/gpu/run_gpu_checks.py`` on a lent GPU; importable anywhere (torch and CUDA
are touched only inside :func:`check_memory`). It asserts and returns its figures:

1. one GPT block in bf16 saves for backward what Korthikanti et al. count (34·sbh + 5·as²b),
   plus the LayerNorm statistics they leave out, within 1%;
2. mixed-precision AdamW on a ~120M-parameter GPT holds 16 bytes per parameter, counted from
   the storages (within 1%) *and* seen by ``torch.cuda.memory_allocated`` (within 2%);
3. during a training step ``torch.cuda.max_memory_allocated`` reaches at least model state +
   saved activations, and not much more (the rest is transient: logits' gradients, workspaces).
"""

from __future__ import annotations

from typing import Any

GPT_KWARGS = {"vocab": 8192, "d_model": 1024, "n_heads": 16, "n_layers": 8, "seq_len": 512}
MICRO_BATCH, SEQ_LEN = 8, 512


def korthikanti_bytes() -> int:
    """Saved activations of the measured GPT by Korthikanti et al.'s formula (runs on CPU too,
    so a renamed config key fails a CPU test rather than a lent GPU's only run)."""
    from dplab.memory import gpt_activation_bytes

    cfg = GPT_KWARGS
    return gpt_activation_bytes(
        SEQ_LEN, MICRO_BATCH, cfg["d_model"], cfg["n_heads"], cfg["n_layers"]
    )


def check_memory() -> dict[str, Any]:
    import torch

    from dplab.memory import gpt_block_activation_bytes
    from dplab.memory.gpt import lm_loss, measured_gpt, random_batch
    from dplab.memory.measure import (
        SavedTensors,
        block_saved_bytes,
        layernorm_stats_bytes,
        make_recipe,
        measure_held,
        train_step,
    )

    if not torch.cuda.is_available():
        raise RuntimeError("check_memory needs a CUDA GPU")
    dev = torch.device("cuda")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(dev)}
    out["total_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory

    # 1. one block's saved activations against the formula
    blocks = []
    for s, b in [(128, 4), (512, 2)]:
        saved = block_saved_bytes(s, b, hidden=256, heads=8, dtype=torch.bfloat16, device=dev)
        formula = gpt_block_activation_bytes(s, b, 256, 8)
        with_stats = formula + layernorm_stats_bytes(s, b, 4)  # CUDA keeps fp32 statistics
        blocks.append(
            {
                "seq_len": s,
                "micro_batch": b,
                "saved_bytes": saved.nbytes,
                "korthikanti_bytes": formula,
                "by_dtype": saved.by_dtype,
            }
        )
        assert abs(saved.nbytes - with_stats) <= 0.01 * with_stats, blocks[-1]
    out["block_activations"] = blocks

    # 2. model state: storages and the allocator agree on 16 B/param.
    # Warm up first: cuBLAS allocates its workspace (tens of MiB on Hopper) through torch's
    # allocator on first use; it must sit in the baseline, not in the model's bytes.
    for dtype in (torch.bfloat16, torch.float32):
        warm = torch.nn.Linear(64, 64, device=dev, dtype=dtype)
        warm(torch.randn(8, 64, device=dev, dtype=dtype)).sum().backward()
    del warm
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.manual_seed(0)
    model, opt = make_recipe(measured_gpt(**GPT_KWARGS).to(dev), "mixed", "adam")
    x, y = random_batch(model.vocab, MICRO_BATCH, SEQ_LEN, device=dev)
    train_step(model, opt, [(x, y)])
    torch.cuda.synchronize()
    held = measure_held(model, opt)
    allocated = torch.cuda.memory_allocated(dev) - base
    out["n_params"] = held.n_params
    out["state_bytes"] = held.state_bytes
    out["bytes_per_param"] = held.bytes_per_param
    out["allocated_after_step_bytes"] = allocated
    assert abs(held.bytes_per_param - 16) <= 0.16, held.to_dict()
    state_and_buffers = held.state_bytes + held.parts["buffers"]
    # the batch (x, y) is alive too: a few tens of KB
    assert abs(allocated - state_and_buffers) <= 0.02 * state_and_buffers, out

    # 3. a second step: peak = state + activations + transients
    opt.zero_grad(set_to_none=False)  # grads stay allocated, as DDP's buckets keep them
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(dev)
    start = torch.cuda.memory_allocated(dev) - base
    with SavedTensors(model) as saved:
        loss = lm_loss(model, x, y)
    loss.backward()
    opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev) - base
    out["saved_activation_bytes"] = saved.nbytes
    out["korthikanti_model_bytes"] = korthikanti_bytes()
    out["allocated_before_step_bytes"] = start
    out["peak_bytes"] = peak
    out["peak_over_state_plus_activations"] = peak / (held.state_bytes + saved.nbytes)
    assert peak >= held.state_bytes + saved.nbytes, out
    assert out["peak_over_state_plus_activations"] < 1.5, out
    del model, opt, loss, x, y
    torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(check_memory(), indent=2))
