"""``chat-e --model DIR`` (or ``python -m chat_e --model DIR``): serve a dialogue model with the Chat-E UI, its
``chat`` API endpoint and an OpenAI-compatible API at ``/v1`` (:mod:`chat_e.http.openai_api`); ``chat-e --backend URL
--model NAME``: the same in front of a remote OpenAI-compatible server (:mod:`chat_e.engines.remote`).

Both families are served: an encoder-decoder (BlenderBot) and a decoder-only chat model (such as SmolLM2), from a
recipe's output dir, an exported merge or a PEFT adapter dir. The generation flags are
:class:`chat_e.data.settings.GenerationSettings`' fields, the limits' flags :class:`chat_e.data.limits.ChatLimits`'.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from dataclasses import dataclass, fields
from typing import Any

from hf_ext.saving.gguf import GGUF_SET
from hf_ext.saving.model_dir import ModelDirError as ModelLoadError
from hf_ext.saving.model_dir import describe_model_dir, is_gguf_file

from .data.limits import ChatLimits
from .data.settings import SETTINGS, resolve_quantize, setting_type
from .engines.remote import BACKEND_API_KEY_ENV
from .feedback.cli import DESCRIPTION as FEEDBACK_DESCRIPTION
from .feedback.cli import add_db_argument, add_feedback_commands
from .feedback.cli import run as run_feedback
from .feedback.store import DEFAULT_RUN_DIR, FeedbackStore, default_url
from .http.guard import ADMIN_ENV, API_KEY_ENV, AUTH_ENV, exposure_warning, parse_auth
from .server import bind
from .training.eval_cli import DESCRIPTION as EVAL_DESCRIPTION
from .training.eval_cli import add_eval_arguments
from .training.eval_cli import run as run_eval
from .training.launch import DESCRIPTION as TRAIN_DESCRIPTION
from .training.launch import add_train_arguments
from .training.launch import run as run_training

logger = logging.getLogger("chat-e")
SHARE_REFUSAL = (
    "--share is not supported: Chat-E serves its UI and API on one app, which Gradio's share link cannot tunnel. "
    "Publish it as a Space (make space; docs/chat-e.md) or put it behind a reverse proxy (with --auth and --api_key)."
)


ARENA_DESCRIPTION = (
    "A blind arena: the same message goes to two models drawn at random and shown as Model A and Model B; the user "
    "votes (A, B, tie, both bad) and only then sees which models they were. The votes go to the feedback database "
    "and rank the models in the Leaderboard tab; first-turn votes export as preference rows (chat-e feedback export)."
)


SERVE_DESCRIPTION = (
    "Serve a dialogue model -- an encoder-decoder (BlenderBot) or a decoder-only chat model (such as SmolLM2): a "
    "recipe's output dir, an exported merge, or a PEFT adapter dir -- with the Chat-E Gradio UI, its `chat` API "
    "endpoint and an OpenAI-compatible API at /v1; or put the UI and the API in front of a remote OpenAI-compatible "
    "server (--backend)."
)
#: ``chat-e``'s subcommands; ``chat-e --model DIR`` (no subcommand) is ``chat-e serve --model DIR``
COMMANDS = ("serve", "arena", "feedback", "train", "eval")


def build_parser() -> argparse.ArgumentParser:
    """``chat-e`` and its subcommands: ``serve`` (the default), ``arena`` and ``feedback``."""
    parser = argparse.ArgumentParser(
        prog="chat-e",
        description="Chat-E: serve a dialogue model with a Gradio UI and an OpenAI-compatible API, compare models "
        "blind, turn what users said into training rows, and train on them.",
        epilog="'chat-e --model DIR ...' is 'chat-e serve --model DIR ...'. 'chat-e COMMAND --help' tells more.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join(COMMANDS) + "}")
    serve = commands.add_parser("serve", help="Serve a model (the default command).", description=SERVE_DESCRIPTION)
    add_serve_arguments(serve)
    arena = commands.add_parser(
        "arena", help="A blind arena between models, and their leaderboard.", description=ARENA_DESCRIPTION
    )
    add_serve_arguments(arena, arena=True)
    feedback = commands.add_parser(
        "feedback", help="Training rows from what users said; the database's upkeep.", description=FEEDBACK_DESCRIPTION
    )
    add_feedback_commands(feedback)
    train = commands.add_parser(
        "train", help="Train a model: dialogue fine-tuning (sft), DPO or KTO.", description=TRAIN_DESCRIPTION
    )
    add_train_arguments(train)
    evaluate = commands.add_parser(
        "eval", help="An offline adherence report of one model, or two side by side.", description=EVAL_DESCRIPTION
    )
    add_eval_arguments(evaluate)
    for command in (serve, arena, feedback, train, evaluate):
        command.set_defaults(command_parser=command)  # its own errors say "chat-e COMMAND: error: ..."
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser, arena: bool = False) -> None:
    """``chat-e serve``'s flags; ``arena``: ``chat-e arena``'s (``--model`` given twice or more, and ``--seed``)."""
    what = "Model directory: config.json or adapter_config.json in it; with --backend, the remote model's name."
    if arena:
        parser.add_argument(
            "--model", action="append", required=True, help=f"A model to compare (twice or more). {what}"
        )
        parser.add_argument("--seed", type=int, default=None, help="Seed of the battles' draws (default: random).")
    else:
        parser.add_argument("--model", required=True, help=what)
        _add_train_page_arguments(parser)
    _add_access_arguments(parser)
    _add_engine_arguments(parser)
    feedback = parser.add_argument_group(
        "feedback (thumbs, corrections, choices: stored to train on; 'chat-e feedback export' makes training rows)"
    )
    add_db_argument(feedback)
    feedback.add_argument(
        "--no_feedback",
        "--no-feedback",
        action="store_true",
        help="Offer no feedback controls and store nothing (privacy).",
    )
    limits = parser.add_argument_group("limits (a request over one is refused with a message saying so)")
    for f in fields(ChatLimits):
        flag = f"--{f.name}"
        limits.add_argument(
            flag,
            flag.replace("_", "-"),
            type=int,
            default=f.default,
            help=f"{f.metadata['help']} (default {f.default:,}).",
        )
    group = parser.add_argument_group("generation defaults (the model's generation_config when not given)")
    for f in SETTINGS:
        flags = dict.fromkeys((f"--{f.name}", f"--{f.name.replace('_', '-')}"))  # one flag when there is no _
        if setting_type(f) is bool:
            group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=f.metadata["help"])
        else:
            group.add_argument(*flags, type=setting_type(f), default=None, help=f.metadata["help"])


def _add_train_page_arguments(parser: argparse.ArgumentParser) -> None:
    train = parser.add_argument_group(
        "training from the feedback (the operator's Train page at /admin; docs/feedback.md)"
    )
    train.add_argument(
        "--admin",
        default=None,
        metavar="USER:PASSWORD",
        help=f"Serve the Train page at /admin behind this login: train the served model on the feedback, watch and "
        f"cancel runs. Default: ${ADMIN_ENV}, else no Train page (/admin does not exist).",
    )
    train.add_argument(
        "--train_args",
        "--train-args",
        default="",
        metavar="FLAGS",
        help='Flags every run\'s training gets first, in one string (e.g. "--config my.yaml").',
    )
    train.add_argument(
        "--eval_args",
        "--eval-args",
        default="",
        metavar="FLAGS",
        help='Flags the eval of every done run gets (chat-e eval\'s, in one string, e.g. "--n_nll 64").',
    )
    train.add_argument(
        "--train_dir",
        "--train-dir",
        default=str(DEFAULT_RUN_DIR / "train"),
        help=f"Where runs write their rows, logs and models (default {DEFAULT_RUN_DIR / 'train'}).",
    )


def _add_access_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (default 127.0.0.1: this machine only).")
    parser.add_argument("--port", type=int, default=7860, help="Port to serve on (default 7860; 0 picks a free one).")
    parser.add_argument(
        "--share",
        action="store_true",
        help="Not supported: Chat-E serves the UI and its API on one FastAPI app, which Gradio's share link cannot "
        "tunnel. Publish a Space instead (make space) or put the server behind a reverse proxy.",
    )
    parser.add_argument(
        "--auth",
        default=None,
        metavar="USER:PASSWORD",
        help=f"Ask for this user and password (Gradio's login page; gradio_client: auth=(user, password)). Default: "
        f"${AUTH_ENV}, else no login.",
    )
    parser.add_argument(
        "--api_key",
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"Let programs in with the header 'Authorization: Bearer KEY' (gradio_client: headers=...). Without "
        f"--auth every request needs it. Default: ${API_KEY_ENV}, else none.",
    )


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default=None,
        metavar="URL",
        help="Generate with a remote OpenAI-compatible server (vLLM, transformers serve, another Chat-E) at URL, "
        "such as http://127.0.0.1:8000/v1, instead of loading --model here. The OpenAI API has no beam search and "
        "no minimum length: --num_beams and --min_new_tokens do not reach it; --dtype, --quantize and --threads "
        "do not apply.",
    )
    parser.add_argument(
        "--backend_api_key",
        "--backend-api-key",
        default=None,
        metavar="KEY",
        help=f"The --backend server's API key (sent as 'Authorization: Bearer KEY'). Default: ${BACKEND_API_KEY_ENV}, "
        "else none.",
    )
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="Weights' precision (default fp32).")
    parser.add_argument(
        "--quantize",
        choices=("auto", "none", "int8"),
        default="auto",
        help="int8: dynamic quantization of Linear layers; auto (default): int8 for fp32 weights (faster CPU serving "
        "at about the same BLEU: docs/benchmarks.md, 'Chat-E serving'), else none.",
    )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="What runs the model: torch (PyTorch, --dtype and --quantize), llamacpp (llama.cpp on a GGUF file: a "
        "--model ending in .gguf, or a model directory exported to --gguf_type once, into its gguf/ folder), or auto "
        "(default): llamacpp for a GGUF file, or for a Llama-architecture directory when llama-cpp-python is "
        "installed and neither --quantize nor --dtype is given (the fastest CPU path with the same greedy replies: "
        "docs/benchmarks.md, 'llama.cpp'), else torch.",
    )
    parser.add_argument(
        "--gguf_type",
        choices=GGUF_SET,
        default="f16",
        help="The GGUF weights a model directory is served in by llama.cpp (default f16: the fp32 model's greedy "
        "replies; q8_0 and q4_k_m are smaller and faster and reply differently: docs/benchmarks.md).",
    )
    parser.add_argument("--concurrency", type=int, default=2, help="Replies generated at the same time (default 2).")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="Torch threads per reply (default: OMP_NUM_THREADS, else CPU cores / --concurrency); llama.cpp's "
        "threads (default: OMP_NUM_THREADS, else every core: it takes replies in turn).",
    )


def torch_threads(requested: int | None, concurrency: int) -> int:
    """Threads per generation: as asked, else OMP_NUM_THREADS, else the cores split between concurrent replies."""
    if requested:
        return requested
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    from hf_ext.runtime import usable_cores  # noqa: PLC0415 (imports torch: only once a model is being loaded)

    return max(1, usable_cores() // max(1, concurrency))


#: ``--engine``'s choices
ENGINES = ("auto", "torch", "llamacpp")


def engine_kind(args, model: str) -> str:
    """``torch`` or ``llamacpp`` for ``model`` (a directory or a GGUF file) under ``args``: a GGUF file is llama.cpp's;
    ``--engine auto`` takes llama.cpp for a Llama-architecture directory when llama-cpp-python is installed, unless a
    flag only PyTorch honours was given (``--quantize int8|none``, ``--dtype bf16``)."""
    from .engines.llamacpp import gguf_exportable, llama_cpp_installed  # noqa: PLC0415 (imports torch)

    if is_gguf_file(model) or args.engine == "llamacpp":
        return "llamacpp"
    torch_flags = args.quantize != "auto" or args.dtype != "fp32"
    if args.engine == "auto" and not torch_flags and llama_cpp_installed() and gguf_exportable(model):
        return "llamacpp"
    return "torch"


def embedded_engine(args, model: str):
    """The :class:`~chat_e.engines.local.LocalEngine` of the directory ``model`` in this process, and its generation defaults
    with the flags' overrides."""
    import torch  # noqa: PLC0415 (heavy: only once the arguments and the model directory are checked)

    from hf_ext.runtime import return_freed_memory_to_os, usable_cores  # noqa: PLC0415 (imports torch)

    from .engines.local import LocalEngine  # noqa: PLC0415 (heavy: imports torch and transformers)

    torch.set_num_threads(torch_threads(args.threads, args.concurrency))
    if engine_kind(args, model) == "llamacpp":
        from .engines.llamacpp import LlamaCppEngine, served_gguf  # noqa: PLC0415 (heavy)

        # one reply at a time on every core: llama.cpp's context takes replies in turn
        threads = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0") or 0) or usable_cores()
        engine = LlamaCppEngine.from_pretrained(served_gguf(model, args.gguf_type), threads=threads)
        # llama.cpp's threads do the work; torch's (a reply's logits processors) would spin on the same cores
        torch.set_num_threads(1)
        engine.info["path"] = str(model)  # what it was asked to serve (a Promote's run folder); the file: "gguf"
    else:
        quantize = resolve_quantize(args.quantize, args.dtype)
        engine = LocalEngine.from_pretrained(model, dtype=args.dtype, quantize=quantize)
    settings = engine.default_settings().replace(**{f.name: getattr(args, f.name) for f in SETTINGS})
    # large request bodies (up to the body limit) come and go: glibc would keep their memory in its heap, its mmap
    # threshold adapting upward, and the server's resident memory would ratchet up under big requests
    return_freed_memory_to_os(threshold=256 * 1024)
    logger.info("loaded %s", engine.describe())
    logger.info("generation defaults: %s; %d torch threads per reply", settings, torch.get_num_threads())
    return engine, settings


def remote_engine(args, model: str):
    """A :class:`~chat_e.engines.remote.RemoteEngine` on ``--backend`` serving ``model``, and its generation defaults with
    the flags' overrides."""
    from .engines.remote import RemoteEngine  # noqa: PLC0415 (imports the openai client)

    key = args.backend_api_key or os.environ.get(BACKEND_API_KEY_ENV) or None
    engine = RemoteEngine(args.backend, model, api_key=key)
    settings = engine.default_settings().replace(**{f.name: getattr(args, f.name) for f in SETTINGS})
    engine.settings = settings
    logger.info("generation defaults: %s", settings)
    return engine, settings


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    """``argv`` parsed (no subcommand: ``serve``), and the parser of its command."""
    if not argv or argv[0] not in (*COMMANDS, "-h", "--help"):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    return args, args.command_parser


class Refusal(Exception):
    """``chat-e serve`` cannot run as asked: the message says what to change. ``usage``: a flag is wrong (argparse's
    form: the command's usage, then the message); else one line ``chat-e: error: ...``."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


@dataclass
class ServeOptions:
    """``chat-e serve`` / ``chat-e arena``'s arguments, checked (:func:`validate`)."""

    args: argparse.Namespace
    arena: bool
    models: list[str]
    limits: ChatLimits
    auth: tuple[str, str] | None
    admin: tuple[str, str] | None
    api_key: str | None

    def server(self) -> dict[str, Any]:
        """:func:`chat_e.server.serve`'s keyword arguments from these options: where, the logins, the limits."""
        args = self.args
        return dict(host=args.host, port=args.port, auth=self.auth, api_key=self.api_key, limits=self.limits)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args, parser = parse(argv)
    if args.command == "feedback":
        return run_feedback(args)
    if args.command == "train":
        return run_training(args, parser)
    if args.command == "eval":
        return run_eval(args, parser, argv[1:])
    try:
        configure_logging()
        return run_server(validate(args))
    except Refusal as err:
        if err.usage:
            parser.error(str(err))
        print(f"chat-e: error: {err}", file=sys.stderr)
        return 2


def validate(args: argparse.Namespace) -> ServeOptions:
    """``chat-e serve``'s (or ``arena``'s) arguments checked, every refusal here and before any heavy import: the flags
    together, the logins, and the model directories (without loading them); a server exposed without a login or a
    key is warned of."""
    arena = args.command == "arena"
    models = list(dict.fromkeys(args.model)) if arena else [args.model]
    if arena and len(models) < 2:
        raise Refusal("the arena compares models: give --model twice or more, each a different model.", usage=True)
    if arena and args.no_feedback:
        raise Refusal("the arena keeps its votes in the feedback database: drop --no_feedback.", usage=True)
    if args.concurrency < 1:
        raise Refusal("--concurrency must be at least 1.", usage=True)
    if args.quantize == "int8" and args.dtype != "fp32":
        raise Refusal("--quantize int8 works on fp32 weights: drop --dtype bf16 or --quantize int8.", usage=True)
    try:
        limits = ChatLimits(**{f.name: getattr(args, f.name) for f in fields(ChatLimits)})
        auth_value = args.auth or os.environ.get(AUTH_ENV)
        auth = parse_auth(auth_value) if auth_value else None
        admin_value = None if arena else args.admin or os.environ.get(ADMIN_ENV)
        admin = parse_auth(admin_value, "--admin") if admin_value else None
    except ValueError as err:
        raise Refusal(str(err), usage=True) from None
    if args.share:
        raise Refusal(SHARE_REFUSAL)
    if admin and args.no_feedback:
        raise Refusal("--admin trains on the feedback database: drop --no_feedback.", usage=True)
    if admin and args.backend:
        raise Refusal(
            "--admin trains the served model on this machine: give --model DIR without --backend.", usage=True
        )
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    warning = exposure_warning(args.host, auth is not None, api_key is not None)
    if warning:  # said whether or not the rest is refused: the command line is what exposes the server
        logger.warning(warning)
        print(f"chat-e: WARNING: {warning}", file=sys.stderr, flush=True)
    if not args.backend:
        try:
            for model in models:
                describe_model_dir(model)
        except ModelLoadError as err:
            raise Refusal(str(err)) from None
    return ServeOptions(args, arena, models, limits, auth, admin, api_key)


def configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for name in ("httpx", "httpx2"):  # a line per request otherwise (the openai client logs through httpx2)
        logging.getLogger(name).setLevel(logging.WARNING)


def run_server(options: ServeOptions) -> int:
    """Open the feedback database, check the port, load the models, build the app and serve it until stopped."""
    args = options.args
    from .web.ui import import_gradio  # noqa: PLC0415 (heavy: only once the arguments and the model are checked)

    try:
        import_gradio()
    except ImportError as err:
        raise Refusal(str(err)) from None
    store = None if args.no_feedback else open_store(args.feedback_db)
    if args.port:  # a port in use is said now, not after loading the models (port 0: serving picks a free one)
        try:
            bind(args.host, args.port).close()
        except OSError as err:
            raise Refusal(f"cannot serve on {args.host}:{args.port}: {err}") from None
    try:
        loaded = {model: (remote_engine if args.backend else embedded_engine)(args, model) for model in options.models}
    except ModelLoadError as err:
        raise Refusal(str(err)) from None
    demo, routers, mounts = build_server(options, loaded, store)
    logger.info(
        "limits: %s; login %s, API key %s",
        options.limits,
        "on" if options.auth else "off",
        "on" if options.api_key else "off",
    )
    from .server import serve  # noqa: PLC0415 (heavy: only once the arguments and the model are checked)

    try:
        serve(demo, routers=routers, mounts=mounts, **options.server())
    except OSError as err:
        raise Refusal(f"cannot serve on {args.host}:{args.port}: {err}") from None
    except RuntimeError as err:
        print(f"chat-e: error: {err}", file=sys.stderr)
        return 1
    return 0


def open_store(url: str | None) -> FeedbackStore:
    """The feedback database at ``url`` (the default one when None), created or upgraded as needed."""
    url = url or default_url()
    try:
        store = FeedbackStore(url)
    except Exception as err:
        raise Refusal(f"cannot open the feedback database {url}: {' '.join(str(err).split())}") from None
    logger.info("feedback: stored in %s", store.describe())
    return store


def build_server(options: ServeOptions, loaded: dict, store: FeedbackStore | None) -> tuple[Any, list, list]:
    """The app's parts from the loaded ``{model: (engine, settings)}``: the Gradio UI (the chat, or the arena), the
    API routers and the mounted pages (the Train page and its arena). Each engine gets the one limit on its replies
    at once, for the UI and the API alike; with the Train page the served model is swappable (Promote, Roll back)."""
    from .engines.gate import GatedEngine  # noqa: PLC0415 (heavy: only once the arguments and the model are checked)

    args, limits = options.args, options.limits
    settings = {name: default for name, (_, default) in loaded.items()}
    engines = {name: engine for name, (engine, _) in loaded.items()}
    if options.admin:
        from .engines.switch import SwitchableEngine  # noqa: PLC0415 (the operator's page only)

        engines = {name: SwitchableEngine(engine) for name, engine in engines.items()}
    engines = {name: GatedEngine(engine, args.concurrency) for name, engine in engines.items()}
    if options.arena:
        from .web.arena import build_arena  # noqa: PLC0415 (heavy: scipy and choix, for the arena only)

        demo = build_arena(
            engines,
            record_vote=lambda vote: store.add_vote(**vote),
            load_votes=store.vote_outcomes,
            settings=settings,
            limits=limits,
            seed=args.seed,
            concurrency_limit=args.concurrency,
        )
        return demo, [], []
    from .http.openai_api import openai_router  # noqa: PLC0415 (heavy: only once the arguments and the model are checked)
    from .web.ui import build_app  # noqa: PLC0415 (heavy: gradio)

    (engine,), (default,) = engines.values(), settings.values()
    demo = build_app(engine, default, concurrency_limit=args.concurrency, limits=limits, store=store)
    mounts = train_page_mounts(options, engine, default, store) if options.admin else []
    return demo, [openai_router(engine, default, limits)], mounts


def train_page_mounts(options: ServeOptions, engine, default, store: FeedbackStore) -> list:
    """The Train page at ``/admin`` (behind ``--admin``'s login) and the app's own blind arena at ``/arena`` (behind
    the chat's), which the Train page opens between the served model and a run's."""
    from .studio.page import build_train_app  # noqa: PLC0415 (heavy: the operator's page only)
    from .studio.runs import RunManager  # noqa: PLC0415 (heavy: the operator's page only)
    from .studio.serving import ServingDesk  # noqa: PLC0415 (heavy: the operator's page only)
    from .web.arena import Arena, arena_blocks  # noqa: PLC0415 (heavy: scipy and choix)

    args = options.args
    manager = RunManager(store, args.model, args.train_dir, shlex.split(args.train_args), shlex.split(args.eval_args))
    in_app = Arena(
        {},
        record_vote=lambda vote: store.add_vote(**vote),
        load_votes=store.vote_outcomes,
        limits=options.limits,
        closed=True,
    )
    desk = ServingDesk(
        engine, default, manager, load=lambda path: embedded_engine(args, path), open_arena=in_app.set_models
    )
    logger.info("the Train page: /admin (its own login), its arena: /arena; runs in %s", args.train_dir)
    return [
        ("/admin", build_train_app(manager, store, desk, options.limits), options.admin),
        ("/arena", arena_blocks(in_app, args.concurrency), options.auth),
    ]


if __name__ == "__main__":
    sys.exit(main())
