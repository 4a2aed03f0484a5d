"""`decapybara serve`: the server on this machine in one command (Ray Serve underneath), with the original's
flags (`--host 127.0.0.1 --port 8080 --kv-mode 6/6 ...`); any other AppConfig field via `--set key=value`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from decapybara.errors import ConfigError

FLAGS = {  # flag -> AppConfig field
    "model": "model", "preset": "preset", "slots": "slots", "kv_mode": "kv_mode", "api_key": "api_key",
    "prefill_policy": "prefill_policy", "loop_guard": "loop_guard", "context_mode": "context_mode",
    "ram_cache_gb": "ram_cache_gb", "disk_cache": "disk_cache", "device": "device", "rope_scaling": "rope_scaling",
    "max_model_len": "max_model_len", "keep_free_gb": "keep_free_gb", "speculator": "speculator",
    "draft_len": "draft_len",
}


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the OpenAI + Anthropic server on this machine")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port_number, default=8000, help="TCP port of the HTTP server (1-65535)")
    s.add_argument("--model", help=".mcapy path, fsspec URL or the name of one in the model folders (`decapybara "
                   "models`; default: the embedded demo model)")
    s.add_argument("--preset", choices=["max_efficiency", "medium", "max_quality"])
    s.add_argument("--slots", type=int, help="conversations decoding together (1-12)")
    s.add_argument("--kv-mode", dest="kv_mode", help="KV key/value bits: 16/16, 8/8, 6/6, 6/4, 4/4")
    s.add_argument("--api-key", dest="api_key", help="required as Bearer / x-api-key (not for /health)")
    s.add_argument("--prefill-policy", dest="prefill_policy",
                   choices=["balanced", "decode-priority", "prefill-priority"])
    s.add_argument("--loop-guard", dest="loop_guard", choices=["stop", "end_thinking", "escape", "off"])
    s.add_argument("--context-mode", dest="context_mode", choices=["pool", "fixed"])
    s.add_argument("--rope-scaling", dest="rope_scaling", choices=["auto", "off", "1m"],
                   help="YaRN context extension: auto (to --max-model-len or the preset's context where longer than "
                   "the model's), 1m (1,048,576 tokens), off")
    s.add_argument("--max-model-len", dest="max_model_len", type=int, help="the longest context a conversation has")
    s.add_argument("--ram-cache-gb", dest="ram_cache_gb", type=float)
    s.add_argument("--disk-cache", dest="disk_cache", help="fsspec URL of the disk KV tier")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"])
    s.add_argument("--speculator", choices=["mtp", "ngram", "off"],
                   help="mtp: draft each agent's next token with the model's MTP head, verified in its decode; "
                   "ngram: draft what followed the last three tokens earlier in the conversation (any model)")
    s.add_argument("--draft-len", dest="draft_len", type=int, choices=range(8), metavar="0-7",
                   help="the most tokens an agent drafts a step (with CUDA graphs a step of decodes alone at most "
                   "what a verification graph takes: up to 7, on a hybrid model fewer the more agents decode); 0 "
                   "drafts nothing")
    s.add_argument("--keep-free-gb", dest="keep_free_gb", type=float,
                   help="device memory (GiB) left to other programs; the KV pool takes the rest (CUDA)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other AppConfig field")
    s.set_defaults(func=cmd_serve)


def port_number(text: str) -> int:
    """`--port`'s value: a TCP port, 1-65535 (argparse's one-line error otherwise, before Ray starts)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is not between 1 and 65535")
    return port


def app_args(args: argparse.Namespace) -> dict[str, Any]:
    """The AppConfig arguments the flags ask for, validated (ConfigError naming the problem)."""
    from pydantic import ValidationError

    from decapybara.server.config import AppConfig

    out: dict[str, Any] = {field: getattr(args, flag) for flag, field in FLAGS.items()
                           if getattr(args, flag, None) is not None}
    given = {field: "--" + flag.replace("_", "-") for flag, field in FLAGS.items() if field in out}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key = key.strip()
        if key in given:  # one of the two would be dropped unsaid
            raise ConfigError(f"{key} is given twice ({given[key]} and --set {item})")
        out[key], given[key] = value, f"--set {item}"
    try:
        cfg = AppConfig(**out)
    except ValidationError as e:
        raise ConfigError(f"bad server settings: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None
    preflight(cfg)
    return out


def preflight(cfg: Any, device: bool = True) -> None:
    """The checks the GPU actor makes as it starts, made here, before Ray starts, so that a bad setting is one
    line and not a failed deployment: the model found (a name in the model folders, a path, a URL), its context
    plan (`context_plan`: e.g. a max_model_len past the trained context with rope_scaling off), the disk tier's
    folder (`check_disk_cache`) and, with `device` (this process serves on this machine, as `decapybara serve`
    does; not `build_app`, whose actors may run elsewhere), where device=cuda, a CUDA device."""
    from decapybara.launcher.discover import describe

    path = cfg.resolved_model()
    found = describe(path)
    if found.error:
        raise ConfigError(f"cannot read the model {path!r}: {found.error}")
    cfg.context_plan(found.context)
    check_disk_cache(cfg)
    if not device:
        return
    try:
        cfg.use_cuda()
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_disk_cache(cfg: Any) -> None:
    """The disk tier's folder made (as DiskTierStore does) and written to, so an unusable one is refused here."""
    if cfg.ram_cache_gb <= 0 or cfg.disk_cache_gb <= 0:  # no tiers (the scheduler starts them over a RAM tier)
        return
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(cfg.disk_cache)
        fs.makedirs(root, exist_ok=True)
        probe = f"{root.rstrip('/')}/.decapybara-write-test"
        fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as e:  # noqa: BLE001 - any failure means the tier cannot work
        raise ConfigError(f"disk_cache {cfg.disk_cache!r} is not usable: {type(e).__name__}: {e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    import signal

    import ray
    from ray import serve

    from decapybara.server.ingress import application

    settings = app_args(args)
    # NOTE: ray.init installs Ray's own SIGTERM handler (a stack dump), so ours goes in again after it; a SIGTERM
    # while Ray starts still meets Ray's. (Blocking the signal meanwhile would leave it blocked in the processes
    # Ray starts, which inherit the mask.)
    serve_started = False
    try:
        stop_on_sigterm()
        ray.init()
        stop_on_sigterm()
        serve.start(http_options={"host": args.host, "port": args.port})
        serve_started = True
        serve.run(application(settings, checked=True), name="decapybara", route_prefix="/", blocking=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the usual ways to stop it, not errors (Ray stops at exit)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one while Ray shuts down ends the process
        if serve_started:  # a graceful stop: the ingress saves the prefix cache to the disk tier first
            print("decapybara: stopping (the prefix cache goes to the disk tier; Ctrl-C again skips it)",
                  file=sys.stderr)
            try:
                serve.delete("decapybara")  # waits out the replica's whole stop (serve.shutdown's own wait is 30 s)
            except KeyboardInterrupt:
                print("decapybara: the save was skipped", file=sys.stderr)
            except Exception as e:  # noqa: BLE001 - stopping anyway
                print(f"decapybara: {type(e).__name__}: {e}", file=sys.stderr)
        print("decapybara: stopped", file=sys.stderr)
    return 0


def stop_on_sigterm() -> None:
    """SIGTERM (kill, systemd, docker stop) stops the server as Ctrl-C does: as a KeyboardInterrupt in the main
    thread."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
