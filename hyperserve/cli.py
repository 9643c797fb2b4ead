"""The `hyperserve` command: generate, chat, serve, ray-serve, gateway, bench."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import uuid
from pathlib import Path
from typing import get_args

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded at run time


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def _sampling_params(args: argparse.Namespace):
    from hyperserve.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        max_tokens=args.max_tokens, seed=args.sampling_seed,
    )


def _engine(args: argparse.Namespace):
    from hyperserve.config import engine_kwargs_from_args
    from hyperserve.engine.engine import LLMEngine

    return LLMEngine.from_kwargs(**engine_kwargs_from_args(args))


def stream(engine, prompt: str | list[int], params, out=sys.stdout) -> str:
    """Run one request, printing text as it is produced; returns the full text."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    shown = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id:
                    text = output.outputs[0].text
                    out.write(text[len(shown):])
                    out.flush()
                    shown = text
    except KeyboardInterrupt:
        engine.abort_request(request_id)
    out.write("\n")
    return shown


def cmd_generate(args: argparse.Namespace) -> None:
    params = _sampling_params(args)  # a bad setting fails before the model loads
    stream(_engine(args), args.prompt, params)


def cmd_chat(args: argparse.Namespace) -> None:
    params = _sampling_params(args)  # a bad setting fails before the model loads
    engine = _engine(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("Chatting with", args.model, "- /reset clears the conversation, Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except EOFError:
            print()
            return
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        try:
            answer = stream(engine, engine.apply_chat_template(messages), params)
        except ValueError as error:  # no chat template, or the conversation outgrew the context
            print(f"error: {error}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})


ANSWER_FLAGS = ("default_max_tokens", "reasoning_parser", "tool_call_parser")  # what _answer_args adds


def _answer_args(parser: argparse.ArgumentParser) -> None:
    """What `serve`, `ray-serve` and `run-batch` decide of chat answers above the engine."""
    parser.add_argument("--default-max-tokens", type=int, default=2048,
                        help="the most tokens a chat request that sets no max_tokens generates")
    parser.add_argument("--reasoning-parser", choices=["qwen3", "deepseek_r1"], default=None,
                        help="put a reasoning model's <think>...</think> in chat answers' reasoning_content")
    parser.add_argument("--tool-call-parser", default=None,
                        choices=["qwen3_coder", "hermes", "llama3_json", "mistral", "granite"],
                        help="how the model writes tool calls (default: as its chat template renders them, "
                             "else hermes)")


def _security_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security (API keys, limits, guardrails)")
    group.add_argument("--api-key", default=os.environ.get("HYPERSERVE_API_KEY"),
                       help="a single key clients must send (default: $HYPERSERVE_API_KEY)")
    group.add_argument("--security-config", default=None,
                       help="keys file (YAML/JSON): hashed keys, per-key models, limits, budgets, guardrails")
    group.add_argument("--protect-metrics", action="store_true", default=None,
                       help="/metrics needs a key too")
    group.add_argument("--audit-log", default=None,
                       help="JSON-lines audit log (who, model, tokens, verdicts)")
    group.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                       help="web pages on these origins (e.g. https://app.example.com, or *) may call "
                            "the API from a browser (CORS); default: none but this server's own pages")


def _with_cors(app, args: argparse.Namespace):
    """Browsers may call the API from --allowed-origins. Outermost, so that preflight requests,
    which carry no API key, are answered before the key is asked for."""
    if args.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], max_age=600,
                           expose_headers=["X-Request-Id", "Retry-After", "Server-Timing",
                                           "x-hyperserve-cache", "x-hyperserve-backend"]
                           + [f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset")
                              for unit in ("requests", "tokens")])
    return app


def _governor(args: argparse.Namespace):
    """None when no security option is given: the server stays open, as before."""
    if args.api_key is None and args.security_config is None and args.audit_log is None:
        return None
    from hyperserve.security.config import load_security_config
    from hyperserve.security.middleware import Governor

    config = load_security_config(args.security_config, args.api_key, protect_metrics=args.protect_metrics,
                                  audit_log=args.audit_log)
    return Governor(config)


def _ray_serve_args(parser: argparse.ArgumentParser) -> None:
    """One flag per RayServeConfig field (replicas, autoscaling, resources, routing, keys)."""
    from hyperserve.ray_serve import RayServeConfig

    for name, field in RayServeConfig.model_fields.items():
        if name in ("model", "engine") or name in ANSWER_FLAGS:  # add_engine_args' and _answer_args'
            continue
        if name == "lora_modules":
            parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                                help=field.description)
            continue
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                                help=field.description)
            continue
        kind = next(t for t in (int, float, str) if t is field.annotation or t in get_args(field.annotation))
        parser.add_argument(flag, type=kind, default=field.default, help=field.description)


def cmd_ray_serve(args: argparse.Namespace) -> None:
    import logging

    from hyperserve.config import EngineConfig, engine_kwargs_from_args
    from hyperserve.ray_serve import RayServeConfig, run

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = {k: v for k, v in engine_kwargs_from_args(args).items() if k != "model"}
    EngineConfig.from_kwargs(**engine)  # bad engine flags fail here, before Ray starts
    options = {name: getattr(args, name) for name in RayServeConfig.model_fields
               if name not in ("model", "engine")}
    options["lora_modules"] = {name: lora.lora_path
                               for name, lora in _lora_modules(args.lora_modules).items()}
    run(RayServeConfig(model=args.model or "smollm2-135m", engine=engine, **options), args.address, args.host,
        args.port)


def cmd_keys(args: argparse.Namespace) -> None:
    import secrets

    from hyperserve.security.config import hash_key

    key = "hs-" + secrets.token_urlsafe(32)
    print(f"key (give it to {args.name}; it is not stored anywhere): {key}", file=sys.stderr)
    print(f"- name: {args.name}\n  sha256: {hash_key(key)}")


def cmd_serve(args: argparse.Namespace) -> None:
    import logging

    import uvicorn

    from hyperserve.config import EngineConfig, engine_kwargs_from_args
    from hyperserve.engine.engine import LLMEngine
    from hyperserve.engine.memory import estimate_memory_bytes
    from hyperserve.server.app import build_app
    from hyperserve.server.model_pool import ModelEntry
    from hyperserve.server.settings import ServerSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    names = args.model or ["smollm2-135m"]
    unknown = set(args.on_demand) - set(names)
    if unknown or len(set(names)) != len(names):
        sys.exit("error: --on-demand names models given with --model, each once; "
                 f"not {sorted(unknown) or names}")
    if args.lora_on_demand and args.lora_dir is None:
        sys.exit("error: --lora-on-demand loads adapters from --lora-dir: give it too")
    adapters = _lora_modules(args.lora_modules)
    with_lora = bool(adapters) or args.lora_dir is not None
    configs = {name: EngineConfig.from_kwargs(**{**engine_kwargs_from_args(args), "model": name,
                                                 "enable_lora": args.enable_lora or (with_lora and i == 0)})
               for i, name in enumerate(names)}  # bad flags fail before binding
    served = {name: (args.served_model_name if i == 0 and args.served_model_name else name)
              for i, name in enumerate(names)}
    models = [ModelEntry(served[name], functools.partial(LLMEngine, configs[name]), name in args.on_demand,
                         adapters if i == 0 else {}, estimate_memory_bytes(configs[name]))
              for i, name in enumerate(names)]
    settings = ServerSettings(model_name=served[names[0]], max_queue=args.max_queue,
                              max_body_bytes=args.max_body_bytes, default_max_tokens=args.default_max_tokens,
                              max_pin_ttl_s=args.max_pin_ttl_s, role=args.role, prefill_url=args.prefill_url,
                              prefill_api_key=args.prefill_api_key, disagg_min_tokens=args.disagg_min_tokens,
                              prefill_timeout_s=args.prefill_timeout_s,
                              responses_store_bytes=int(args.responses_store_mb * 2**20),
                              reasoning_parser=args.reasoning_parser,
                              tool_call_parser=args.tool_call_parser, files_dir=args.files_dir,
                              batch_concurrency=args.batch_concurrency,
                              batch_concurrency_busy=args.batch_concurrency_busy)
    failed: list[str] = []

    def stop(reason: str) -> None:
        """The model did not load, or the engine stopped for good: exit non-zero once running
        requests have had their errors, so a supervisor starts a fresh process."""
        failed.append(reason)
        server.should_exit = True

    governor = _governor(args)
    cached = args.semantic_cache or args.response_cache
    if args.embedding_model is not None:
        from hyperserve.common.embedder import WINDOWS

        if args.embedding_model not in WINDOWS:
            sys.exit(f"error: --embedding-model must be one of {', '.join(WINDOWS)}, "
                     f"not {args.embedding_model!r}")
    if cached and args.embedding_model:
        sys.exit("error: --embedding-model is served without the response cache; drop --semantic-cache and "
                 "--response-cache, or serve embeddings from a second `hyperserve serve`")
    # behind the cache, the front's Batch API answers /v1/files and /v1/batches
    app = build_app(models, dataclasses.replace(settings, batch_api=False) if cached else settings,
                    governor=None if cached else governor,
                    on_load_error=lambda error: stop(f"the model failed to load: {error}"),
                    on_engine_dead=lambda error: stop(f"the engine stopped: {type(error).__name__}: {error}"),
                    max_loaded_models=args.max_loaded_models, idle_unload_s=args.idle_unload_s,
                    lora_dir=Path(args.lora_dir) if args.lora_dir else None,
                    lora_on_demand=args.lora_on_demand,
                    memory_budget_bytes=int(args.memory_budget_gb * 2**30) if args.memory_budget_gb else None,
                    embedding_model=args.embedding_model)
    if cached:
        app = _cached_front(app, settings, [m.name for m in models], args, governor)
    app = _with_cors(app, args)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                           timeout_graceful_shutdown=args.shutdown_grace_s))
    server.run()
    if failed:
        sys.exit(f"error: {failed[0]}")


def cmd_run_batch(args: argparse.Namespace) -> None:
    import asyncio

    from hyperserve.config import EngineConfig, engine_kwargs_from_args
    from hyperserve.engine.engine import LLMEngine
    from hyperserve.server.app import build_app
    from hyperserve.server.model_pool import ModelEntry
    from hyperserve.server.run_batch import run_batch
    from hyperserve.server.settings import ServerSettings

    config = EngineConfig.from_kwargs(**engine_kwargs_from_args(args))
    name = args.served_model_name or args.model
    entry = ModelEntry(name, functools.partial(LLMEngine, config), adapters=_lora_modules(args.lora_modules))
    settings = ServerSettings(model_name=name, max_queue=max(256, 2 * args.max_concurrency),
                              default_max_tokens=args.default_max_tokens,
                              reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                              batch_concurrency=args.max_concurrency,
                              batch_concurrency_busy=args.max_concurrency)
    app = build_app([entry], settings, embedding_model=args.embedding_model, idle_unload_s=None)
    try:
        counts = asyncio.run(run_batch(app, Path(args.input), Path(args.output)))
    except RuntimeError as error:
        sys.exit(f"error: {error}")
    print(f"{counts['completed']} of {counts['total']} requests answered, {counts['failed']} failed: "
          f"{args.output}", file=sys.stderr)


def _lora_modules(specs: list[str]) -> dict:
    """--lora-modules NAME=PATH ... -> {NAME: LoRARequest}."""
    from hyperserve.layers.lora import LoRARequest

    adapters = {}
    for i, spec in enumerate(specs, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            sys.exit(f"error: --lora-modules takes NAME=PATH, got {spec!r}")
        adapters[name] = LoRARequest(name, i, path)
    return adapters


def _cached_front(engine_app, settings, model_names: list[str], args: argparse.Namespace, governor):
    """The gateway's response cache in front of this process's own engine (served on a private
    Unix socket), as `hyperserve gateway` would put it in front of a remote one."""
    from hyperserve.gateway.app import build_gateway_app
    from hyperserve.gateway.config import parse_config

    config = parse_config({
        "backends": [{"name": "engine", "url": "http://engine"}],
        "routes": [{"model": name, "backends": ["engine"]} for name in model_names],
        "cache": {"path": args.response_cache_path, "ttl_s": args.response_cache_ttl_s,
                  "semantic": {"enabled": args.semantic_cache, "threshold": args.semantic_cache_threshold}},
    }, source="serve flags")
    return build_gateway_app(config, embedded={"engine": engine_app}, max_body_bytes=settings.max_body_bytes,
                             governor=governor, files_dir=settings.files_dir and Path(settings.files_dir))


def cmd_gateway(args: argparse.Namespace) -> None:
    import logging

    import uvicorn

    from hyperserve.gateway.app import build_gateway_app
    from hyperserve.gateway.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = _with_cors(build_gateway_app(load_config(args.config), max_body_bytes=args.max_body_bytes,
                                       governor=_governor(args),
                                       files_dir=args.files_dir and Path(args.files_dir)), args)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                access_log=not args.quiet, timeout_graceful_shutdown=args.shutdown_grace_s)


def cmd_bench(args: argparse.Namespace) -> None:
    from hyperserve.bench.run import run_from_args

    result = run_from_args(args)
    for summary in result.get("sweep", [result] if "runs" not in result else []):
        # a script must not take nothing for a measurement
        if summary["num_requests"] and not summary["num_ok"]:
            raise ValueError(f"no request succeeded at {summary['concurrency'] or summary['request_rate']} "
                             f"({summary['num_failed']} failed); nothing was measured")


def build_parser() -> argparse.ArgumentParser:
    from hyperserve.config import add_engine_args

    parser = argparse.ArgumentParser(prog="hyperserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt, streaming the text")
    generate.add_argument("prompt")
    _sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive chat through the model's chat template")
    chat.add_argument("--system", default=None, help="system prompt")
    _sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="name clients use (default: --model)")
    serve.add_argument("--max-queue", type=int, default=256, help="waiting requests before 429")
    serve.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    serve.add_argument("--max-pin-ttl-s", type=float, default=3600.0,
                       help="the longest ttl of a /v1/cache pin")
    serve.add_argument("--responses-store-mb", type=float, default=64.0,
                       help="memory for stored /v1/responses answers (previous_response_id); 0 stores none")
    _answer_args(serve)
    serve.add_argument("--files-dir", default=None,
                       help="where the Batch API keeps /v1/files "
                            "(default: a temporary directory, gone at exit)")
    serve.add_argument("--batch-concurrency", type=int, default=16,
                       help="requests of all /v1/batches in the engine at once while it serves nothing else")
    serve.add_argument("--batch-concurrency-busy", type=int, default=2,
                       help="... while it serves other requests, and for 5 s after the last")
    serve.add_argument("--shutdown-grace-s", type=float, default=30.0,
                       help="on SIGTERM, how long running requests may take to finish")
    disagg = serve.add_argument_group("disaggregated prefill (long prompts computed by another server)")
    disagg.add_argument("--role", choices=["both", "prefill", "decode"], default="both",
                        help="prefill: serve POST /v1/kv/prefill; "
                             "decode: send long prompts to --prefill-url first")
    disagg.add_argument("--prefill-url", default=None, help="the prefill server (--role decode)")
    disagg.add_argument("--prefill-api-key", default=os.environ.get("HYPERSERVE_PREFILL_API_KEY"),
                        help="its API key (or $HYPERSERVE_PREFILL_API_KEY)")
    disagg.add_argument("--disagg-min-tokens", type=int, default=256,
                        help="prompts with at least this many tokens not in the prefix cache "
                             "go to the prefill server")
    disagg.add_argument("--prefill-timeout-s", type=float, default=30.0,
                        help="after this, the prompt is computed here instead")
    cache = serve.add_argument_group("response cache (the gateway's, in front of this engine)")
    cache.add_argument("--response-cache", action="store_true",
                       help="answer repeated deterministic requests from the cache (exact match)")
    cache.add_argument("--semantic-cache", action="store_true",
                       help="also answer paraphrases (all-MiniLM-L6-v2 embeddings); implies --response-cache")
    cache.add_argument("--semantic-cache-threshold", type=float, default=0.9,
                       help="cosine similarity for a hit")
    cache.add_argument("--response-cache-path", default=".hyperserve/response-cache.sqlite")
    cache.add_argument("--response-cache-ttl-s", type=float, default=86400.0)
    models = serve.add_argument_group("several models (--model given more than once)")
    models.add_argument("--embedding-model", default=None, metavar="NAME",
                        help="also serve /v1/embeddings with this sentence encoder, shipped offline: "
                             "all-MiniLM-L6-v2 or multilingual-e5-small")
    models.add_argument("--on-demand", nargs="+", default=[], metavar="MODEL",
                        help="of the --model names, those loaded when first asked for and unloaded when idle")
    models.add_argument("--idle-unload-s", type=float, default=300.0,
                        help="an on-demand model unloads after this long without requests")
    models.add_argument("--max-loaded-models", type=int, default=None,
                        help="at most this many models loaded at once "
                             "(the least recently used on-demand one goes)")
    models.add_argument("--memory-budget-gb", type=float, default=None,
                        help="the loaded models' weights and KV pools together stay within this (the least "
                             "recently used on-demand model goes); size each pool with --kv-cache-memory-gb")
    models.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT folders) on the first model, each served as model NAME")
    models.add_argument("--lora-dir", default=None,
                        help="the folder POST /v1/load_lora_adapter may load adapters from")
    models.add_argument("--lora-on-demand", action="store_true",
                        help="a request whose model is a folder of --lora-dir holding an adapter loads it "
                             "(vLLM's filesystem LoRA resolver)")
    _security_args(serve)
    add_engine_args(serve, repeatable=("model",))
    serve.set_defaults(func=cmd_serve)

    batch = commands.add_parser("run-batch", help="an OpenAI batch file (JSONL) through the model, offline")
    batch.add_argument("-i", "--input", required=True, help="the requests: OpenAI's batch input lines")
    batch.add_argument("-o", "--output", required=True,
                       help="the results: OpenAI's batch output lines, in order")
    batch.add_argument("--max-concurrency", type=int, default=64, help="requests in the engine at once")
    batch.add_argument("--served-model-name", default=None, help="the name the lines' `model` may give")
    _answer_args(batch)
    batch.add_argument("--embedding-model", default=None, metavar="NAME",
                       help="serve /v1/embeddings lines with this sentence encoder")
    batch.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters, each served as model NAME")
    add_engine_args(batch)
    batch.set_defaults(func=cmd_run_batch)

    gateway = commands.add_parser("gateway",
                                  help="OpenAI-compatible gateway: caching, routing, fallback, cascades")
    gateway.add_argument("--config", required=True, help="gateway YAML (see examples/gateway.yaml)")
    gateway.add_argument("--host", default="127.0.0.1")
    gateway.add_argument("--port", type=int, default=8080)
    gateway.add_argument("--max-body-bytes", type=int, default=4 * 2**20)
    gateway.add_argument("--shutdown-grace-s", type=float, default=30.0)
    gateway.add_argument("--files-dir", default=None,
                         help="where the Batch API keeps /v1/files "
                              "(default: a temporary directory, gone at exit)")
    gateway.add_argument("--quiet", action="store_true", help="no access log")
    _security_args(gateway)
    gateway.set_defaults(func=cmd_gateway)

    ray = commands.add_parser("ray-serve",
                              help="replicas on a Ray cluster: autoscaled, routed by prompt prefix")
    ray.add_argument("--address", default=None,
                     help="a Ray cluster to join ('auto': the one `ray start` made on this machine); "
                          "none: start one")
    ray.add_argument("--host", default="127.0.0.1")
    ray.add_argument("--port", type=int, default=8000)
    _ray_serve_args(ray)
    _answer_args(ray)
    add_engine_args(ray)
    ray.set_defaults(func=cmd_ray_serve)

    keys = commands.add_parser("keys",
                               help="make an API key and its keys-file entry (only the hash is stored)")
    keys.add_argument("action", choices=["new"])
    keys.add_argument("--name", required=True)
    keys.set_defaults(func=cmd_keys)

    from hyperserve.bench.run import add_bench_args

    bench = commands.add_parser("bench", help="load generator for any OpenAI-compatible server")
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except ValueError as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
