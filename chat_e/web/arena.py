"""Chat-E's blind arena: one message to two models drawn at random, shown as "Model A" and "Model B"; the user votes
for the better reply, and only then learns which models they were. The votes rank the models
(:mod:`chat_e.feedback.leaderboard`).

A battle's pairing lives in a ``gr.State`` -- kept on the server, never sent to the browser -- until the vote, which
ends the battle: the names are revealed and a second vote on it is refused. Each side keeps its own conversation (a
model sees its own earlier replies), as in FastChat's arena.

The events take their inputs raw and check them with :func:`chat_e.data.limits.check_request`, through the main UI's
:meth:`chat_e.web.ui.Handlers.check` (one :class:`~chat_e.web.ui.Handlers` per engine, which also holds the engine's
generation settings): the same rules, the same refusals. Named endpoints, for ``gradio_client``: ``battle``
(``message, mode, context``: both replies), ``vote`` (``winner``: the reveal), ``new_battle`` and ``leaderboard``.

This module takes no ``from __future__ import annotations``: Gradio finds the ``gr.Request`` parameter of an event
handler by its evaluated annotation, and the handlers are closures over the lazily imported ``gradio``.
"""

import collections
import dataclasses
import logging
import random
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data.limits import ChatLimits
from ..data.settings import GenerationSettings
from ..engines.base import ReplyStream
from ..feedback.leaderboard import DECISIVE, Leaderboard, as_vote, leaderboard, matrix_png
from ..feedback.store import WINNERS, utcnow
from .ui import (
    APOLOGY,
    EMPTY_REPLY,
    GENERATE_GROUP,
    Handlers,
    checked_request,
    context_controls,
    import_gradio,
    message_row,
    to_display,
)

if TYPE_CHECKING:
    from ..engines.base import ChatEngine

logger = logging.getLogger(__name__)

ARENA_TITLE = "Chat-E arena"
#: the vote buttons' labels, by FastChat's vote kind
VOTE_LABELS = {"model_a": "A is better", "model_b": "B is better", "tie": "Tie", "bothbad": "Both are bad"}
SIDE_LABELS = {"model_a": "Model A", "model_b": "Model B"}
#: what :func:`build_arena`'s ``record_vote`` receives, key by key (see :meth:`Arena.vote`)
VOTE_KEYS = (
    "session_id",
    "battle_id",
    "turn",
    "model_a",
    "model_b",
    "winner",
    "mode",
    "context",
    "history",
    "message",
    "reply_a",
    "reply_b",
    "settings",
    "created_at",
)
#: what a battle in an arena with no models set (the Train page opens one) is told
CLOSED = "No arena is open now: the operator opens one from the Train page, between the served model and a new one."
DEFAULT_PLOT_DIR = Path(tempfile.gettempdir()) / "chat-e-arena"
#: battle ids the arena remembers as voted on (the newest), against a session's racing second vote
VOTED_MEMORY = 4096
assert tuple(VOTE_LABELS) == WINNERS


def draw_pair(names: Sequence[str], rng: random.Random) -> tuple[str, str]:
    """Two different models of ``names``, ``(left, right)``: uniform over the ordered pairs, so every pair is as
    likely as any other and each of its models is on the left half the time."""
    if len(set(names)) < 2:
        raise ValueError(f"A battle needs two different models; got {list(names)}.")
    left, right = rng.sample(sorted(set(names)), 2)
    return left, right


@dataclass(frozen=True)
class Battle:
    """One battle as the server keeps it (a session's ``gr.State``): the pairing, each side's conversation as plain
    turns, and the last exchange -- what a vote records. ``turn`` counts the exchanges; ``winner`` is the vote once
    cast; ``failed``: a reply could not be generated (the battle cannot be voted on)."""

    battle_id: str
    model_a: str
    model_b: str
    turn: int = 0
    turns_a: tuple[str, ...] = ()
    turns_b: tuple[str, ...] = ()
    history_a: tuple[str, ...] = ()
    history_b: tuple[str, ...] = ()
    message: str = ""
    reply_a: str = ""
    reply_b: str = ""
    mode: str = ""
    context: str = ""
    winner: str | None = None
    failed: bool = False

    def chats(self) -> tuple[list[dict], list[dict]]:
        """Both sides' conversations as chat-window messages."""
        return _chat(self.turns_a), _chat(self.turns_b)

    def reveal(self) -> str:
        """Who was who, and the vote."""
        return (
            f"**Model A** was `{self.model_a}`, **Model B** was `{self.model_b}`. "
            f"Your vote: {VOTE_LABELS[self.winner]}. Press **New battle** for another pair."
        )


def _chat(turns: Sequence[str]) -> list[dict]:
    roles = ("user", "assistant")
    return [{"role": roles[i % 2], "content": to_display(t)} for i, t in enumerate(turns)]


class Arena:
    """The arena's handlers over ``engines`` (name -> engine): pairing, generation, votes, the leaderboard.

    Args:
        engines: at least two, by the name that votes and the leaderboard use.
        record_vote: called once per accepted vote with its dict (:data:`VOTE_KEYS`).
        load_votes: every vote so far, for the leaderboard: ``(model_a, model_b, winner)`` tuples
            (:meth:`chat_e.feedback.store.FeedbackStore.vote_outcomes`) or dicts with those keys.
        settings: the generation settings of every engine, or of each by name (an engine's own defaults when None
            or not named).
        limits: what a request may carry (:class:`~chat_e.data.limits.ChatLimits`).
        seed: the pairings' random seed (None: unseeded).
        plot_dir: where the win-rate matrix's PNGs are written.
        closed: an arena whose models are set later (:meth:`set_models`; the Train page's arena between the served
            model and a run's): ``engines`` may be empty, a battle is refused until two are set, and the leaderboard
            counts only the votes between the models set.
    """

    def __init__(
        self,
        engines: Mapping[str, "ChatEngine"],
        *,
        record_vote: Callable[[dict], Any],
        load_votes: Callable[[], Sequence[Mapping]],
        settings: GenerationSettings | Mapping[str, GenerationSettings] | None = None,
        limits: ChatLimits | None = None,
        seed: int | None = None,
        plot_dir: str | Path = DEFAULT_PLOT_DIR,
        closed: bool = False,
    ):
        if len(engines) < 2 and not closed:
            raise ValueError(f"The arena needs at least two models; got {len(engines)}.")
        self.limits = limits or ChatLimits()
        self.record_vote = record_vote
        self.load_votes = load_votes
        self.plot_dir = Path(plot_dir)
        self.closed = closed
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        #: each model's generation settings as a vote records them, kept for models set aside (a battle under way)
        self._settings: dict[str, dict] = {}
        self.handlers: dict[str, Handlers] = {}
        self.names: list[str] = []
        self.set_models(engines, settings)
        # the newest battle ids with a recorded vote (one vote per battle, even when a session's two clicks race):
        # a race is over in seconds, so the memory is bounded (a battle's own state refuses a later second vote)
        self._voted: collections.OrderedDict[str, None] = collections.OrderedDict()

    def set_models(
        self,
        engines: Mapping[str, "ChatEngine"],
        settings: GenerationSettings | Mapping[str, GenerationSettings] | None = None,
    ) -> None:
        """Battle between ``engines`` (by name) from now on; a battle under way between models no longer set is
        refused its next message (its vote is still taken)."""
        if settings is None or isinstance(settings, GenerationSettings):
            settings = dict.fromkeys(engines, settings)
        handlers = {name: Handlers(engine, settings.get(name), self.limits) for name, engine in engines.items()}
        with self._lock:
            self.handlers, self.names = handlers, list(engines)
            self._settings.update({name: dataclasses.asdict(h.settings) for name, h in handlers.items()})

    # ---- battles -------------------------------------------------------------------------------------------------

    def draw(self) -> Battle:
        """A new battle: a pair drawn by :func:`draw_pair` from the shared, seeded rng."""
        with self._lock:
            if len(self.names) < 2:
                raise import_gradio().Error(CLOSED, title="Chat-E arena", print_exception=False)
            model_a, model_b = draw_pair(self.names, self._rng)
        return Battle(uuid.uuid4().hex, model_a, model_b)

    def new_battle(self):
        """A new pair, the chat windows and the reveal cleared: ``(state, chat A, chat B, reveal, message box)``."""
        return self.draw(), [], [], "", ""

    def check(self, where: str, **fields):
        """The main UI's check (:meth:`chat_e.web.ui.Handlers.check`): a refusal is a ``gr.Error``."""
        return checked_request(self.limits, self.ranges, where, **fields)

    @property
    def ranges(self) -> dict[str, tuple[float, float]]:
        """The settings' ranges :meth:`check` applies (a battle's messages carry no settings: any model's)."""
        handlers = self.handlers
        return next(iter(handlers.values())).ranges if handlers else {}

    # long: one battle from the message to the state, both streams read in turn and closed on any end
    def battle(self, message: Any, mode: Any, context: Any, battle: Battle | None) -> Iterator[tuple]:
        """Send ``message`` to both models of the session's battle (a new one is drawn when there is none) and stream
        both replies side by side: yields ``(message box, chat A, chat B, state)``, the state once, at the end."""
        gr = import_gradio()
        if battle is not None and battle.winner is not None:
            raise gr.Error(
                "This battle is over: you have voted and seen the models. Press New battle for another pair.",
                title="Chat-E arena",
                print_exception=False,
            )
        checked = self.check("battle", message=message, mode=mode, context=context)
        battle = battle or self.draw()
        sides = (battle.model_a, battle.model_b)
        handlers = self.handlers
        if not all(name in handlers for name in sides):
            raise gr.Error(
                "The arena's models have changed since this battle began. Press New battle for another pair.",
                title="Chat-E arena",
                print_exception=False,
            )
        histories = [self.check("battle", history=list(t)).history for t in (battle.turns_a, battle.turns_b)]
        chats = [[*chat, {"role": "user", "content": to_display(checked.message)}] for chat in battle.chats()]
        for chat in chats:
            chat.append({"role": "assistant", "content": ""})
        yield "", chats[0], chats[1], gr.skip()

        replies, failed = ["", ""], [False, False]
        streams: dict[int, ReplyStream] = {}
        for i, name in enumerate(sides):
            h = handlers[name]
            streams[i] = h.engine.stream(checked.but(history=histories[i], settings=h.settings))
        try:
            while streams:  # one piece from each side in turn, so that both replies grow together
                for i in list(streams):
                    try:
                        replies[i] += next(streams[i])
                    except StopIteration:
                        del streams[i]
                        continue
                    except Exception:
                        logger.exception("generation failed (arena, %s, %d turns)", sides[i], len(histories[i]))
                        failed[i] = True
                        del streams[i]
                        continue
                    chats[i][-1]["content"] = to_display(replies[i])
                yield "", chats[0], chats[1], gr.skip()
        finally:
            for stream in streams.values():
                stream.close()  # a reader that went away stops the generation
        shown = [APOLOGY if failed[i] else replies[i] or EMPTY_REPLY for i in range(2)]
        for i in range(2):
            chats[i][-1]["content"] = APOLOGY if failed[i] else to_display(shown[i])
        battle = dataclasses.replace(
            battle,
            turn=battle.turn + 1,
            turns_a=(*histories[0], checked.message, shown[0]),
            turns_b=(*histories[1], checked.message, shown[1]),
            history_a=tuple(histories[0]),
            history_b=tuple(histories[1]),
            message=checked.message,
            reply_a=replies[0],  # as the model made them (an empty one is shown as EMPTY_REPLY)
            reply_b=replies[1],
            mode=checked.mode,
            context=checked.context,
            failed=battle.failed or any(failed),
        )
        yield "", chats[0], chats[1], battle

    # ---- votes ---------------------------------------------------------------------------------------------------

    def vote(self, winner: Any, battle: Battle | None, session_id: str = "") -> tuple[Battle, str]:
        """Record the session's vote on its battle (once) and reveal the models: ``(state, reveal)``.

        ``record_vote`` receives :data:`VOTE_KEYS`: the session id (``gr.Request.session_hash``), the battle id, the
        turn (1 after the first exchange), the models' real names (A on the left), the winner (a
        :data:`~chat_e.feedback.leaderboard.WINNERS` kind), the last exchange's mode and context, ``history`` (each side's
        earlier plain turns, as that model saw them: ``{"model_a": [...], "model_b": [...]}``), the message, both
        replies, ``settings`` (each side's generation settings: ``{"model_a": {...}, "model_b": {...}}``) and the
        time (UTC). A vote without a reply to vote on, on a battle whose reply failed, or on a
        battle already voted on is refused (a ``gr.Error``) and not recorded."""
        gr = import_gradio()

        def refuse(text: str):
            logger.info("refused (vote): %s", text)
            return gr.Error(text, title="Chat-E arena", print_exception=False)

        if winner not in WINNERS:
            raise refuse(f"A vote is one of {', '.join(WINNERS)}, not {str(winner)[:40]!r}.")
        if battle is None or battle.turn == 0:
            raise refuse("There is nothing to vote on yet: send a message to both models first.")
        if battle.failed:
            raise refuse("A reply in this battle could not be generated, so it cannot be voted on. Press New battle.")
        if battle.winner is not None:
            raise refuse(
                f"This battle has been voted on already ({VOTE_LABELS[battle.winner]}); the models were "
                f"{battle.model_a} (A) and {battle.model_b} (B). Press New battle for another pair."
            )
        with self._lock:
            if battle.battle_id in self._voted:
                raise refuse("This battle has been voted on already. Press New battle for another pair.")
            self._voted[battle.battle_id] = None
            while len(self._voted) > VOTED_MEMORY:
                self._voted.popitem(last=False)
        record = {
            "session_id": session_id,
            "battle_id": battle.battle_id,
            "turn": battle.turn,
            "model_a": battle.model_a,
            "model_b": battle.model_b,
            "winner": winner,
            "mode": battle.mode,
            "context": battle.context,
            "history": {"model_a": list(battle.history_a), "model_b": list(battle.history_b)},
            "message": battle.message,
            "reply_a": battle.reply_a,
            "reply_b": battle.reply_b,
            "settings": {side: self._settings[name] for side, name in zip(DECISIVE, (battle.model_a, battle.model_b))},
            "created_at": utcnow(),
        }
        try:
            self.record_vote(record)
        except Exception:
            logger.exception("recording a vote failed (battle %s)", battle.battle_id)
            with self._lock:
                self._voted.pop(battle.battle_id, None)
            raise refuse("Your vote could not be recorded; please vote again.") from None
        battle = dataclasses.replace(battle, winner=winner)
        return battle, battle.reveal()

    # ---- the leaderboard -----------------------------------------------------------------------------------------

    def board(self) -> Leaderboard:
        """The leaderboard of the arena's models (and any other model the stored votes name; of a ``closed``
        arena, the votes between its models set now only)."""
        names = list(self.names)
        votes = self.load_votes()
        if self.closed:
            votes = [v for v in votes if set(as_vote(v)[:2]) <= set(names)]
        return leaderboard(votes, names)

    def leaderboard(self):
        """``(table, text, matrix PNG)`` for the Leaderboard tab; votes that cannot be loaded or read are a
        ``gr.Error`` (logged with their traceback)."""
        try:
            board = self.board()
        except Exception:
            logger.exception("the leaderboard could not be computed")
            raise import_gradio().Error(
                "The votes could not be loaded; please try again later.", title="Chat-E arena", print_exception=False
            ) from None
        png = matrix_png(board.matrix, self.plot_dir) if len(board.matrix.models) >= 2 else None
        return board.value(), board.text, str(png) if png else None


def controls(battle: Battle | None) -> list:
    """The Arena tab's controls fitted to the battle: the vote buttons live while there is an unvoted reply, the
    message box and Send until the vote, the chat windows' labels the models' names once voted."""
    gr = import_gradio()
    open_ = battle is None or battle.winner is None
    can_vote = battle is not None and battle.turn > 0 and open_ and not battle.failed
    labels = [
        SIDE_LABELS[side] + ("" if open_ else f": {name}")
        for side, name in zip(DECISIVE, (battle.model_a, battle.model_b) if battle else ("", ""))
    ]
    return [
        *[gr.update(interactive=can_vote)] * len(VOTE_LABELS),
        gr.update(interactive=open_),
        gr.update(interactive=open_),
        gr.update(label=labels[0]),
        gr.update(label=labels[1]),
    ]


def build_arena(engines: Mapping[str, "ChatEngine"], *, concurrency_limit: int = 2, **options: Any):
    """The arena's Blocks (tabs "Arena" and "Leaderboard") over ``engines``; ``options`` are :class:`Arena`'s keyword
    arguments (``record_vote`` and ``load_votes`` among them). Battles run at most ``concurrency_limit`` at a time
    (each generates two replies), and at most ``limits.max_queue`` requests wait."""
    return arena_blocks(Arena(engines, **options), concurrency_limit)


def arena_blocks(arena: Arena, concurrency_limit: int = 2):  # long: a Blocks layout, in the page's order
    """:func:`build_arena`'s Blocks over an :class:`Arena` made by the caller (one whose models change: the Train
    page's)."""
    gr = import_gradio()
    generate = dict(concurrency_limit=concurrency_limit, concurrency_id=GENERATE_GROUP)
    ui = dict(api_visibility="undocumented")
    raw = dict(preprocess=False)  # the handlers check their inputs themselves (check_request)

    def battle(message, mode, context, state):
        yield from arena.battle(message, mode, context, state)

    def battle_on_page(message, mode, context, state):
        """:meth:`Arena.battle` for the page: a refusal is a toast, and the windows and the message keep what they
        show (a ``gr.Error`` would mark each of them "Error" and end the chain before the controls are unlocked)."""
        try:
            yield from arena.battle(message, mode, context, state)
        except gr.Error as refused:
            gr.Warning(refused.message, title=refused.title)
            yield gr.skip(), gr.skip(), gr.skip(), gr.skip()

    # Gradio hands a handler the request (the session) by its parameter's annotation, ``gr.Request``
    def vote(winner, state, request: gr.Request):
        return arena.vote(winner, state, request.session_hash or "")

    def voter(kind: str):
        def vote_kind(state, request: gr.Request):
            return arena.vote(kind, state, request.session_hash or "")

        return vote_kind

    def lock():
        return [gr.update(interactive=False)] * (len(VOTE_LABELS) + 2)

    with gr.Blocks(title=ARENA_TITLE, analytics_enabled=False) as demo:
        gr.Markdown(f"# {ARENA_TITLE}")
        with gr.Tab("Arena"):
            gr.Markdown(
                "Two models answer each message; they are shown as **Model A** and **Model B** and named only "
                "after you vote for the better one. Keep chatting before voting if you like: the vote ends the "
                "battle."
            )
            state = gr.State(None)
            with gr.Row():
                with gr.Column(scale=1, min_width=260):
                    mode, context = context_controls("arena-")
                with gr.Column(scale=3):
                    with gr.Row():
                        windows = [
                            gr.Chatbot(
                                label=SIDE_LABELS[side],
                                elem_id=f"chat-{side}",
                                height=380,
                                render_markdown=False,
                                feedback_options=None,
                                buttons=["copy"],
                            )
                            for side in DECISIVE
                        ]
                    with gr.Row():
                        buttons = {
                            kind: gr.Button(label, interactive=False, elem_id=f"vote-{kind}")
                            for kind, label in VOTE_LABELS.items()
                        }
                    reveal = gr.Markdown(elem_id="reveal")
                    message, send = message_row(
                        gr, "Type a message for both models and press Enter", "arena-message", "arena-send"
                    )
                    new = gr.Button("New battle", size="sm", elem_id="new-battle")
                    # the ``vote`` endpoint: the winner as text (the buttons above call the same handler)
                    winner = gr.Textbox(visible=False)
                    vote_api = gr.Button(visible=False)
                    battle_api = gr.Button(visible=False)
        with gr.Tab("Leaderboard") as board_tab:
            refresh = gr.Button("Refresh", elem_id="refresh")
            board_text = gr.Markdown(elem_id="board-text")
            table = gr.Dataframe(interactive=False, elem_id="board-table")
            matrix = gr.Image(type="filepath", label="Win rate (row against column)", elem_id="win-matrix")

        shown = [*buttons.values(), message, send, *windows]
        gr.on([message.submit, send.click], lock, None, [*buttons.values(), message, send], queue=False, **ui).then(
            battle_on_page, [message, mode, context, state], [message, *windows, state], **ui, **raw, **generate
        ).then(controls, [state], shown, queue=False, **ui)
        # the ``battle`` endpoint: a program gets the refusal as an error
        battle_api.click(
            battle, [message, mode, context, state], [message, *windows, state], api_name="battle", **raw, **generate
        )
        for kind, button in buttons.items():
            button.click(voter(kind), [state], [state, reveal], **ui).then(controls, [state], shown, queue=False, **ui)
        vote_api.click(vote, [winner, state], [state, reveal], api_name="vote", **raw).then(
            controls, [state], shown, queue=False, **ui
        )
        new.click(arena.new_battle, None, [state, *windows, reveal, message], api_name="new_battle").then(
            controls, [state], shown, queue=False, **ui
        )
        gr.on(
            [refresh.click, board_tab.select],
            arena.leaderboard,
            None,
            [table, board_text, matrix],
            api_name="leaderboard",
        )

    demo.queue(default_concurrency_limit=concurrency_limit, max_size=arena.limits.max_queue)
    return demo
