"""``dtorch llama``: text generation with a Llama-style causal LM on a dtorch mesh (HF ``generate``, KV cache).

Without ``--model-path`` it builds a tiny random Llama and a character tokenizer offline (runs anywhere in
seconds; the text is gibberish but deterministic); ``--model-path DIR`` loads a local Hugging Face folder
(``config.json``, ``*.safetensors``, tokenizer files), each worker receiving only its shards. Tokens stream as they
are generated; then prefill and decode throughput are printed. Example::

    dtorch llama --mesh dp=1,tp=2,pp=2,cp=1 --prompt "Hello" --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

from torch_dtorch.apps.cli_args import add_mesh_arguments, mesh_parser

__all__ = ["add_parser", "main", "parse_mesh"]

log = logging.getLogger(__name__)

_AXES = ("dp", "tp", "pp", "cp")


#: ``"dp=1,tp=2,pp=2,cp=1"`` -> ``{"tp": 2, "pp": 2}`` (axes of size 1 dropped, order kept; ``{"dp": 1}`` when
#: every axis is 1)
parse_mesh = mesh_parser(axes=_AXES, all_ones="dp")


def add_parser(sub: Any) -> None:
    """Register ``dtorch llama`` on the top-level sub-parsers."""
    p = sub.add_parser(
        "llama",
        help="text generation with a Llama on a dtorch mesh (tiny random model by default)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model-path", type=Path, default=None, help="local Hugging Face model folder")
    add_mesh_arguments(
        p,
        parse=parse_mesh,
        default="tp=2",
        mesh_help="axes NAME=SIZE of dp, tp, pp, cp (default tp=2)",
        compile_help='forward through torch.compile(backend="dtorch")',
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default=None, help="tiny model dtype"
    )
    p.add_argument("--prompt", default="Hello, dtorch!")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed generate calls first (compiles, fills caches)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main)


class _Streamer:
    """An HF generation streamer (``put`` / ``end``): prints each new token as it arrives and stamps the times."""

    def __init__(self, tokenizer: Any, *, echo: bool) -> None:
        self.tokenizer = tokenizer
        self.echo = echo
        self.stamps: list[float] = []
        self.tokens: list[int] = []

    def put(self, value: Any) -> None:
        first = not self.stamps
        self.stamps.append(time.perf_counter())
        if first:  # the prompt
            return
        ids = [int(v) for v in value.reshape(-1).tolist()]
        self.tokens += ids
        if self.echo:
            sys.stdout.write(self.tokenizer.decode(ids))
            sys.stdout.flush()

    def end(self) -> None:
        if self.echo:
            sys.stdout.write("\n")
            sys.stdout.flush()


def _load(args: argparse.Namespace, mesh: Any) -> tuple[Any, Any]:
    import torch

    from torch_dtorch.apps.llama.parallelize import parallelize_llama

    if args.model_path is None:
        from torch_dtorch.apps.llama.tiny import char_tokenizer, tiny_llama

        model = tiny_llama(seed=args.seed)
        if args.dtype is not None:
            model = model.to(getattr(torch, args.dtype))
        return parallelize_llama(model, mesh, cp_mode=args.cp_mode), char_tokenizer()
    if not args.model_path.is_dir():
        raise SystemExit(f"dtorch llama: --model-path {args.model_path} is not a folder")
    from transformers import AutoTokenizer

    from torch_dtorch.apps.llama.checkpoint import load_llama

    return load_llama(args.model_path, mesh, cp_mode=args.cp_mode), AutoTokenizer.from_pretrained(
        args.model_path, local_files_only=True
    )


def main(args: argparse.Namespace) -> int:
    """Generate once (after ``--warmup`` untimed calls), streaming the tokens; prints prefill and decode tokens/s."""
    import torch

    import torch_dtorch as dt
    from torch_dtorch.backend import dtorch_backend

    names, sizes = tuple(args.mesh), tuple(args.mesh.values())
    mesh = dt.init_device_mesh(
        args.device, sizes, mesh_dim_names=names, simulate=args.simulate, mode=args.mode
    )
    t0 = time.perf_counter()
    model, tokenizer = _load(args, mesh)
    if args.compile:
        model.forward = torch.compile(model.forward, backend=dtorch_backend)
    t_load = time.perf_counter() - t0
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    call: dict[str, Any] = {
        "attention_mask": torch.ones_like(ids).to("dtorch"),
        "max_new_tokens": args.max_new_tokens,
        "do_sample": False,
        "pad_token_id": tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
    }
    if args.model_path is None:  # the random model may emit </s> at once: generate every token asked for
        call["min_new_tokens"] = args.max_new_tokens
    t1 = time.perf_counter()
    for _ in range(args.warmup):
        model.generate(ids.to("dtorch"), **call)
    t_warm = time.perf_counter() - t1
    streamer = _Streamer(tokenizer, echo=True)
    sys.stdout.write(args.prompt)
    start = time.perf_counter()
    model.generate(ids.to("dtorch"), streamer=streamer, **call)
    end = time.perf_counter()
    n_new = len(streamer.tokens)
    prefill_s = streamer.stamps[1] - start if n_new else end - start
    decode_s = end - streamer.stamps[1] if n_new else 0.0
    mesh_str = ",".join(f"{n}={s}" for n, s in zip(names, sizes, strict=True))
    print(
        f"dtorch llama: {'tiny random' if args.model_path is None else args.model_path}, mesh {mesh_str} "
        f"({args.mode}, {args.device}{', simulated' if args.simulate else ''}), cp_mode {args.cp_mode}, "
        f"compile {args.compile}"
    )
    print(
        f"  prefill: {ids.shape[1]} tokens in {prefill_s * 1e3:.1f} ms ({ids.shape[1] / prefill_s:.1f} tokens/s, "
        "first token included)"
    )
    if n_new > 1:
        print(
            f"  decode: {n_new - 1} tokens in {decode_s * 1e3:.1f} ms ({(n_new - 1) / decode_s:.1f} tokens/s, "
            f"{decode_s / (n_new - 1) * 1e3:.2f} ms/token)"
        )
    print(f"  load + parallelize {t_load:.2f} s; warm-up ({args.warmup} calls) {t_warm:.2f} s")
    dt.shutdown()
    return 0
