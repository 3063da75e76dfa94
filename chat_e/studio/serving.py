"""From a finished run to the served model, on the Train page: a blind arena between the served model and the run's,
Promote (the run's model served from the next reply on, without a restart), Roll back (the model served before),
and a named side-by-side reply of both for the operator.

* The served model is a :class:`~chat_e.engines.switch.SwitchableEngine` shared with the chat UI and the OpenAI API:
  replies under way when it is swapped finish on the model they started on, and the feedback rows and API answers
  name the model that made each reply.
* A run's model (its output dir: a full model or a LoRA adapter on the served one) is loaded once, when the operator
  first asks for it, and kept while it is the candidate or the model a Roll back returns to. At most three models are
  in memory: the served one, the one before it, and a candidate.
* The arena is the app's own (its votes in the feedback database's tables, its leaderboard with the interval): it
  opens between the served model and the candidate, and closes when the served model changes, as its pairing would no
  longer say which model is served.

A promotion lasts while the server runs: a restarted server serves its ``--model`` (give it the run's output dir to
keep serving that).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..data.limits import Request
from ..data.settings import GenerationSettings
from ..engines.base import ChatEngine
from ..engines.gate import GatedEngine
from ..engines.switch import SwitchableEngine
from ..feedback.store import DONE, utcnow
from .runs import RunManager

logger = logging.getLogger(__name__)

#: a loaded model: the engine (under the server's limit on replies at once) and its generation defaults
Loaded = tuple[ChatEngine, GenerationSettings]


class ServingDesk:
    """The served model's switch and the candidates of :class:`~chat_e.studio.runs.RunManager`'s runs.

    Args:
        served: the served model as the chat UI and the API have it: a :class:`~chat_e.engines.gate.GatedEngine`
            (the server's limit on replies at once) over a :class:`~chat_e.engines.switch.SwitchableEngine`. A
            candidate gets a limit of its own, as large.
        settings: the served model's generation defaults.
        manager: the runs.
        load: loads a model directory as the server does (its flags: dtype, threads, limit): ``(engine, settings)``.
        open_arena: sets the app's arena's models (name -> engine) and their settings; an empty mapping closes it.
    """

    def __init__(
        self,
        served: GatedEngine,
        settings: GenerationSettings,
        manager: RunManager,
        load: Callable[[str], Loaded],
        open_arena: Callable[[Mapping[str, ChatEngine], Mapping[str, GenerationSettings]], None] = lambda *_: None,
    ):
        if not isinstance(served.engine, SwitchableEngine):
            raise TypeError("served must be a GatedEngine over a SwitchableEngine (the model a promotion swaps)")
        self.served, self.switch = served, served.engine
        self.manager, self.load, self._open_arena = manager, load, open_arena
        self._lock = threading.Lock()
        self._serving: Loaded = (self.switch.current, settings)
        self._previous: Loaded | None = None
        #: (run id, its model, the model under its own limit on replies at once)
        self._candidate: tuple[int, Loaded, ChatEngine] | None = None
        #: what the page shows: the served model, since when, from which run
        self.history: list[dict[str, Any]] = [{"model": served.name, "run": None, "at": utcnow(), "action": "start"}]
        self.arena_pair: tuple[str, str] | None = None

    # ---- candidates ------------------------------------------------------------------------------------------

    def finished_runs(self) -> list[dict[str, Any]]:
        """Runs that ended with a model to serve, newest first."""
        return [r for r in self.manager.refresh() if r["status"] == DONE and _has_model(Path(r["output_dir"]))]

    def finished_run(self, run_id: int) -> dict[str, Any]:
        """Run ``run_id``, done with a model to serve (``ValueError`` in one line otherwise)."""
        run = next((r for r in self.finished_runs() if r["id"] == run_id), None)
        if run is None:
            if self.manager.store.run(run_id) is None:
                raise ValueError(
                    f"There is no run #{run_id}: choose a done run's number (the runs table's first column)."
                )
            raise ValueError(f"Run #{run_id} has no model to serve: choose a run that is done.")
        return run

    def export_gguf(self, run_id: int) -> list[Path]:
        """Run ``run_id``'s model (an adapter merged into its base) as GGUF files for llama.cpp, Ollama and the like:
        F16, Q8_0 and Q4_K_M in its output dir's ``gguf/`` folder (the files ``chat-e --engine llamacpp`` serves);
        ``ValueError`` in one line when it cannot be written."""
        from hf_ext.saving.export import export_gguf  # noqa: PLC0415 (heavy: torch and the gguf package)
        from hf_ext.saving.gguf import GGUF_SET, GGUFError  # noqa: PLC0415 (heavy: torch and the gguf package)

        from ..engines.llamacpp import gguf_path  # noqa: PLC0415 (heavy: imports torch)

        out = self.finished_run(run_id)["output_dir"]
        written = []
        for kind in GGUF_SET:
            try:
                written.append(export_gguf(out, gguf_path(out, kind), kind))
            except (GGUFError, FileNotFoundError, OSError) as err:
                raise ValueError(f"Run #{run_id}'s model could not be written as GGUF {kind.upper()}: {err}") from err
        logger.info("run #%d's model as GGUF: %s", run_id, ", ".join(map(str, written)))
        return written

    def candidate(self, run_id: int) -> tuple[Loaded, ChatEngine]:
        """Run ``run_id``'s model, loaded once, and the same under its own limit on replies at once
        (``ValueError``: no such finished run)."""
        with self._lock:
            if self._candidate and self._candidate[0] == run_id:
                return self._candidate[1], self._candidate[2]
        run = self.finished_run(run_id)
        with self._lock:  # served now, or the model a Roll back returns to: loaded already
            known = [m for m in (self._serving, self._previous) if m and _is_dir_of(m[0], run["output_dir"])]
        if known:
            loaded = known[0]
        else:
            loaded = self.load(run["output_dir"])
            loaded[0].name = run_model_id(run)  # what the API, the arena and the feedback rows call it
        gated = GatedEngine(loaded[0], self.served.concurrency)
        with self._lock:
            self._candidate = (run_id, loaded, gated)
        logger.info("run #%d's model: %s", run_id, loaded[0].name)
        return loaded, gated

    # ---- the arena, promotion, roll back ---------------------------------------------------------------------

    def open_arena(self, run_id: int) -> tuple[str, str]:
        """A blind arena between the served model and run ``run_id``'s; the two names."""
        (engine, settings), gated = self.candidate(run_id)
        served, served_settings = self._serving
        if engine.name == served.name:
            raise ValueError(f"Run #{run_id}'s model is the one served: there is nothing to compare it with.")
        self._open_arena(
            {served.name: self.served, engine.name: gated}, {served.name: served_settings, engine.name: settings}
        )
        self.arena_pair = (served.name, engine.name)
        logger.info("arena opened: %s against %s", served.name, engine.name)
        return self.arena_pair

    def promote(self, run_id: int, confirmed: bool = False) -> str:
        """Serve run ``run_id``'s model from the next reply on; its name. Unless ``confirmed``, a ``ValueError`` in one
        line when its eval is missing or says it is worse (:meth:`RunManager.promotion_doubt`)."""
        loaded, _ = self.candidate(run_id)
        doubt = None if confirmed else self.manager.promotion_doubt(run_id)
        if doubt:
            raise ValueError(f"{doubt}: tick 'promote anyway' to promote it all the same.")
        with self._lock:
            if loaded[0].name == self._serving[0].name:
                raise ValueError(f"Run #{run_id}'s model is already served.")
            self._previous, self._serving = self._serving, loaded
            self.switch.swap(loaded[0])
        self._changed("promote", run_id)
        return loaded[0].name

    def rollback(self) -> str:
        """Serve the model served before the last Promote again; its name. (The model rolled back from can be
        promoted again.)"""
        with self._lock:
            if self._previous is None:
                raise ValueError(
                    "Nothing to roll back to: no model has been promoted since the server started "
                    "or since the last Roll back."
                )
            self._previous, self._serving = None, self._previous
            self.switch.swap(self._serving[0])
        self._changed("rollback", None)
        return self._serving[0].name

    def _changed(self, action: str, run_id: int | None) -> None:
        name = self._serving[0].name
        self.history.append({"model": name, "run": run_id, "at": utcnow(), "action": action})
        self._open_arena({}, {})  # its pairing named the model served until now
        self.arena_pair = None
        logger.info("%s: now serving %s (before: %s)", action, name, self._previous[0].name if self._previous else "")

    # ---- side by side ----------------------------------------------------------------------------------------

    def side_by_side(self, run_id: int, request: Request) -> dict:
        """Both models' replies to one checked ``request`` (named, not blind), each with its own settings:
        ``{name: reply}``, served first."""
        (engine, settings), gated = self.candidate(run_id)
        served, served_settings = self._serving
        return {
            served.name: self.served.reply(request.but(settings=served_settings)).text,
            engine.name: gated.reply(request.but(settings=settings)).text,
        }

    def status(self) -> dict[str, Any]:
        """The served model, the one a Roll back returns to, the candidate, the arena's pair, the history."""
        with self._lock:
            return {
                "serving": self._serving[0].name,
                "previous": self._previous[0].name if self._previous else None,  # what a Roll back serves
                "candidate": self._candidate[0] if self._candidate else None,  # its run id
                "arena": self.arena_pair,
                "history": list(self.history),
            }


def run_model_id(run: dict[str, Any]) -> str:
    """A run's model as the app names it everywhere outside the server (``/v1/models``, every answer's ``model``,
    the arena, the feedback rows): ``run-<id>-<method>``, stable and readable; its folder stays on the server."""
    return f"run-{run['id']}-{run['method']}"


def _is_dir_of(engine: ChatEngine, output_dir: str) -> bool:
    """Whether ``engine`` was loaded from ``output_dir``."""
    return Path(engine.info.get("path") or engine.name).resolve() == Path(output_dir).resolve()


def _has_model(out: Path) -> bool:
    return (out / "config.json").is_file() or (out / "adapter_config.json").is_file()
