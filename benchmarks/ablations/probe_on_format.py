"""Issue 51: a sentence probe trained on the states a compact cache format stores, not on the model's own.

With no encoding cache, a parallel encoding reads each block's states as :data:`rag_opt.models.kv_codec.DEFAULT_FORMAT`
stores them (``parallel_features._stored``), and so does ``rag-opt train-probe``'s feature extraction. This runs any
``rag-opt`` command with that default replaced by ``--format``, so a probe is trained on (or evaluated with) the
states that format keeps::

    OMP_NUM_THREADS=1 python benchmarks/ablations/probe_on_format.py --format k4hw3v2 -- -v train-probe \\
        --encoding parallel --layers 16 --dtype bfloat16 --nq 0 --hidden 64 --limit 1500 \\
        --cache /tmp/k4/features --out /tmp/k4/probe.json

Its evaluation, paired with the shipped probe on bf16 entries: ``benchmarks/cache_formats.py --probe FORMAT=PATH``.
"""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("bench.probe_on_format")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--format", required=True, help="the cache format whose stored states the command reads")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the rag-opt command line")
    args = ap.parse_args()
    from rag_opt.cli import main as rag_opt_main
    from rag_opt.models import parallel_features
    from rag_opt.models.kv_codec import resolve_format

    fmt = resolve_format(args.format).name
    parallel_features.DEFAULT_FORMAT = fmt
    rest = args.command[1:] if args.command[:1] == ["--"] else args.command
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logger.info("states read as %s stores them", fmt)
    sys.argv = ["rag-opt", *rest]
    rag_opt_main()


if __name__ == "__main__":
    main()
