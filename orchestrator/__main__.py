"""`python -m orchestrator --target DIR [--drafter DIR] --verifier ADDR [--drafter-address ADDR] --port N`

Runs the orchestrator against already running services, without Ray (useful for
debugging one machine); `specd up` is the normal way, with replicas on Ray.
"""
import argparse
import asyncio
import logging

from specd.spec_config import add_speculative_flags, speculative_config_from_args

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
    add_speculative_flags(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    config = OrchestratorConfig(
        target_dir=args.target, drafter_dir=args.drafter, host=args.host, port=args.port,
        verifier_addresses=args.verifier_address, drafter_addresses=args.drafter_address,
        speculative=speculative_config_from_args(args))

    async def serve():
        server, port = await start_async(config)
        print(f"orchestrator listening on {config.host}:{port}", flush=True)
        await server.wait_for_termination()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
