"""``masrl serve-retriever``: serve a corpus over HTTP (Search-R1 API). Wire with ``register(subparsers)``."""
from __future__ import annotations

import argparse
import sys
import time

from masrl.argtypes import MAX_COUNT, bounded
from masrl.errors import install_command, missing_extra


MAX_QUERY_CHARS = 10 ** 7


def register(subparsers) -> argparse.ArgumentParser:
    """Add the ``serve-retriever`` subcommand; its ``func(args)`` returns an exit code."""
    p = subparsers.add_parser(
        "serve-retriever", help="serve a passage corpus over HTTP (Search-R1 /retrieve API)",
        description="Index a passage corpus (BM25, dense or hybrid) and serve POST /retrieve "
                    '{"queries": [...], "topk": k, "return_scores": bool} on 127.0.0.1.')
    p.add_argument("--corpus", required=True,
                   help="corpus file (.jsonl {id, contents}, [{title, text}] .json, {title: [sentences]} .json, "
                        "raw HotpotQA .json) or 'synthetic_kb'")
    p.add_argument("--format", default="auto", choices=["auto", "jsonl", "json_list", "json_titles", "hotpotqa"])
    p.add_argument("--retriever", default="bm25", choices=["bm25", "dense", "hybrid"],
                   help=f"dense and hybrid need `{install_command('embed')}`")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=bounded(int, 1, 65535), default=8000)
    p.add_argument("--topk", type=bounded(int, 1, MAX_COUNT), default=3, help="topk when a request gives none")
    p.add_argument("--max-topk", type=bounded(int, 1, MAX_COUNT), default=50, help="larger topk requests are capped to this")
    p.add_argument("--max-queries", type=bounded(int, 1, MAX_COUNT), default=512, help="most queries per request")
    p.add_argument("--max-query-chars", type=bounded(int, 1, MAX_QUERY_CHARS), default=2000, help="longer queries are truncated")
    p.add_argument("--max-connections", type=bounded(int, 1, MAX_COUNT), default=256, help="most open connections")
    p.add_argument("--max-connections-per-client", type=bounded(int, 1, MAX_COUNT), default=128,
                   help="most open connections from one address")
    p.add_argument("--header-timeout", type=bounded(float, 0.0, 86400.0, low_open=True), default=10.0,
                   help="seconds a connection may take to send a whole request head before it is closed")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the on-disk index cache")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve_retriever)
    return p


def run_serve_retriever(args: argparse.Namespace) -> int:
    from masrl.errors import UserInputError
    from masrl.retrieval import build_retriever
    try:
        from masrl.retrieval.server import ServerLimits, serve
    except ImportError as e:
        print(f"masrl: error: {missing_extra(f'masrl serve-retriever needs fastapi and uvicorn ({e})', 'server')}",
              file=sys.stderr)
        return 2

    spec = ("synthetic_kb" if args.corpus == "synthetic_kb" else
            {"type": args.retriever, "corpus": args.corpus, "format": args.format, "cache": not args.no_cache})
    start = time.perf_counter()
    try:
        retriever = build_retriever(spec)
    except (UserInputError, RuntimeError, OSError) as e:  # CorpusError, ConfigError (a bad spec), dense model missing
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = len(retriever) if hasattr(retriever, "__len__") else "?"
    print(f"{args.retriever} index over {n} passages ready in {time.perf_counter() - start:.1f} s; "
          f"serving http://{args.host}:{args.port}/retrieve", file=sys.stderr)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding {args.host} exposes the retriever beyond this machine", file=sys.stderr)
    limits = ServerLimits(default_topk=args.topk, max_topk=args.max_topk, max_queries=args.max_queries,
                          max_query_chars=args.max_query_chars, max_connections=args.max_connections,
                          max_connections_per_client=args.max_connections_per_client,
                          header_timeout_s=args.header_timeout)
    try:
        serve(retriever, host=args.host, port=args.port, limits=limits, log_level=args.log_level)
    except OSError as e:
        print(f"error: cannot serve on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    except SystemExit as e:  # uvicorn exits when it cannot bind the port
        if e.code:
            print(f"error: cannot serve on {args.host}:{args.port} (is the port in use?)", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        pass
    return 0
