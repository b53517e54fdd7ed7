"""`hlat-data`: command-line tools for datasets (for now: `sample`).

Why a separate console script: making a dataset is a step before training, often run on another
machine than the trainer, and it should not need a training config. Bad input exits with the
config-error code and a one-line message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hlat_trainer.data.sample import write_sample
from hlat_trainer.errors import UserError

CONFIG_ERROR_EXIT = 2
"""Exit status for bad input (argparse uses the same)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlat-data", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sample = sub.add_parser(
        "sample",
        help="write a sample Arrow dataset and BPE tokenizer from the Python standard library",
    )
    sample.add_argument("--out", type=Path, required=True, help="output directory")
    sample.add_argument(
        "--docs", type=int, default=None, help="number of documents (default: all, ~2000)"
    )
    sample.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size")
    return parser


def run_sample(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    report = write_sample(args.out, args.docs, args.vocab_size)
    print(
        f"wrote {report.dataset}: {report.documents} documents (column 'text'), "
        f"{report.characters / 1e6:.1f}M characters, {report.tokens / 1e6:.2f}M tokens with EOS (estimated)"
    )
    print(f"wrote {report.tokenizer}: byte-level BPE, vocab {report.vocab_size}, EOS <|endoftext|>")
    if report.held_out is not None:
        print(f"wrote {report.held_out}: {report.held_out_documents} held-out documents "
              f"(none in the training set): eval.path={report.held_out.parent}")
    print(
        f"took {time.perf_counter() - t0:.1f}s; train with data.path={report.dataset} "
        f"data.tokenizer={report.tokenizer}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "sample":
            run_sample(args)
    except UserError as exc:
        print(f"hlat-data: error: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
