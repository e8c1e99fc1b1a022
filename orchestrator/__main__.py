"""`python -m orchestrator --target DIR [--drafter DIR] --verifier ADDR [--drafter-address ADDR] --port N`

Runs the orchestrator against already running services, without Ray (useful for
debugging one machine); `specd up` is the normal way, with replicas on Ray.
"""
import argparse
import asyncio
import logging

from .config import OrchestratorConfig
from .server import start_async


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m orchestrator")
    p.add_argument("--target", required=True, help="target model dir (tokenizer, context length)")
    p.add_argument("--drafter", help="drafter model dir")
    p.add_argument("--verifier-address", action="append", required=True)
    p.add_argument("--drafter-address", action="append", default=[])
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--tree", help="default static draft tree, e.g. 3,2,1")
    p.add_argument("--tree-budget", type=int, default=0, help="default dynamic tree of this many nodes")
    p.add_argument("--tree-depth", type=int, default=6)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    config = OrchestratorConfig(
        target_dir=args.target, drafter_dir=args.drafter, host=args.host, port=args.port,
        verifier_addresses=args.verifier_address, drafter_addresses=args.drafter_address,
        default_num_speculative_tokens=args.num_speculative_tokens,
        default_tree_branching=tuple(int(x) for x in args.tree.split(",")) if args.tree else (),
        default_tree_node_budget=args.tree_budget, default_tree_max_depth=args.tree_depth)

    async def serve():
        server, port = await start_async(config)
        print(f"orchestrator listening on {config.host}:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
