"""Which kernel of torch's scaled_dot_product_attention returns NaN at scale 0 over a single key: a
reproduction that needs torch alone, for an upstream report (docs/gpu.md).

    python -m benchmarks.sdpa_nan_repro                  # on CUDA (the default), from the repository
    python -m benchmarks.sdpa_nan_repro --device=cpu     # the same calls on the CPU

The case is the one the suite's torch-sdpa job failed on an H200 (2026-12-04, torch 2.11.0+cu130):
bf16 decode, one query head over one key of head dimension 1, ``scale=0.0``, q = k = v = 0.1259765625
(and v = 0).  The exact result is v: one key has weight 1 whatever the scale.  Each SDPA backend is
forced in turn with ``torch.nn.attention.sdpa_kernel``; also run are fp16, scale 1, head dimensions 8
and 64 and ``enable_gqa``, to say what the NaN depends on.  A line per call: the backend, the case,
the output (or the error: a backend that does not take the case says why), and NaN where the output
has one.  Exit status 0 whatever is found.
"""

from __future__ import annotations

import argparse
import itertools
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"torch's choice": None, "math": SDPBackend.MATH, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
VALUE = 0.1259765625  # q, k and v as the suite drew them (normal, seed 0, in bf16)


def attend(backend, dtype, scale: float, head_dim: int, v_value: float, gqa: bool, device: str):
    """SDPA on q, k, v of shape [1, 1, 1, head_dim] (batch, heads, tokens, head dimension)."""
    q = torch.full((1, 1, 1, head_dim), VALUE, dtype=dtype, device=device)
    k = torch.full((1, 1, 1, head_dim), VALUE, dtype=dtype, device=device)
    v = torch.full((1, 1, 1, head_dim), v_value, dtype=dtype, device=device)
    options = {"scale": scale} | ({"enable_gqa": True} if gqa else {})
    with sdpa_kernel([backend]) if backend is not None else nullcontext():
        return F.scaled_dot_product_attention(q, k, v, **options)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, device {args.device}"
          + (f" ({torch.cuda.get_device_name(args.device)}, cuDNN {torch.backends.cudnn.version()})"
             if args.device.startswith("cuda") else ""))
    nan_in = {}  # backend -> the cases it returned NaN for
    cases = itertools.product((torch.bfloat16, torch.float16), (0.0, 1.0), (1, 8, 64), (VALUE, 0.0), (True, False))
    for dtype, scale, head_dim, v_value, gqa in cases:
        for name, backend in BACKENDS.items():
            case = (f"{str(dtype).removeprefix('torch.')} scale={scale} D={head_dim} v={v_value} "
                    f"enable_gqa={gqa}")
            try:
                out = attend(backend, dtype, scale, head_dim, v_value, gqa, args.device)
            except RuntimeError as e:  # the backend does not take the case (torch says why)
                print(f"{name:<15} {case:<55} not run: {str(e).splitlines()[0][:120]}")
                continue
            first = float(out.flatten()[0])
            nan = bool(torch.isnan(out).any())
            if nan:
                nan_in.setdefault(name, []).append(case)
            print(f"{name:<15} {case:<55} out {first!r}" + ("  NaN" if nan else
                                                            "" if first == v_value else f"  (exact {v_value})"))
    print("NaN (the exact result is v) from: " + ("; ".join(f"{name} in {len(cases)} cases, first {cases[0]}"
                                                           for name, cases in nan_in.items()) or "no backend"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
