"""Chat-E's Gradio UI: a thin layer that lays out Blocks and wires events to a :class:`chat_e.engines.base.ChatEngine`.

Everything a reply depends on travels with the request (the session's chat, the context mode, the settings), so
sessions never share a history. Messages are shown as text: they are HTML-escaped for display and unescaped (an
exact inverse) before they reach the model.

Every event that can reach the model takes its inputs raw (``preprocess=False``) and checks them first, with
:func:`chat_e.data.limits.check_request`: one rule per field for the UI and the API alike, a refusal a ``gr.Error``. What
it returns is what the engine takes: the chat window's messages made plain turns (:mod:`chat_e.data.messages`), the mode
normalized, the settings in their ranges. The generation settings' controls, their order and ranges come from their
declaration, :class:`chat_e.data.settings.GenerationSettings`.
"""

from __future__ import annotations

import functools
import html
import inspect
import logging
import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import pydantic

from ..data.limits import ChatLimits, Refused, Request, check_request
from ..data.messages import message_text
from ..data.samples import EXAMPLES
from ..data.settings import SETTING_NAMES, SETTINGS, GenerationSettings, setting_ranges
from ..engines.base import BackendError

if TYPE_CHECKING:
    from ..engines.base import ChatEngine
    from ..feedback.store import FeedbackStore

logger = logging.getLogger(__name__)

TITLE = "Chat-E"
UI_MODES = ("persona", "emotion", "domain", "topic", "free")
CONTEXT_HINTS = {
    "persona": "Persona: a few sentences about the bot.",
    "emotion": "Emotion: how the conversation feels.",
    "domain": "Domain: what the conversation is about.",
    "topic": "Topic: what to chat about.",
    "free": "Free chat has no context.",
}
APOLOGY = "Sorry, something went wrong while I was thinking of a reply. Please try again."
NOT_SAVED = "Chat-E could not save your feedback just now. Please try again."
#: the choice offered after a regeneration (the ``prefer`` endpoint takes one of them)
PREVIOUS_REPLY, NEW_REPLY = "previous reply", "new reply"
#: what the chat window shows for an empty reply (a model can end its turn at once)
EMPTY_REPLY = "…"
#: a rating as the ``rate`` endpoint takes it -> the stored rating (Gradio's like event: True, False, else taken back)
RATINGS = {"like": 1, "dislike": -1, "none": 0}
#: the chat window's thumbs (Gradio's feedback options) by rating, and the reply record's key holding the one shown
FEEDBACK_OPTIONS = {"like": "Like", "dislike": "Dislike"}
SHOWN_RATING = "shown_rating"
#: the toast a chat user sees once a thumb is stored
RATED = {"like": "Thanks: your thumbs-up is saved.", "dislike": "Thanks: your thumbs-down is saved.",
         "none": "Your rating is taken back."}  # fmt: skip
#: generation runs share this queue group, limited by ``concurrency_limit``
GENERATE_GROUP = "generate"
#: Send, Regenerate, Undo, Clear: locked with the message box while a reply is generated
N_BUTTONS = 4
#: what ``respond`` (the event and the endpoint) takes: the chat window, the mode, the context, then each declared
#: generation setting in its order
RESPOND_PARAMETERS: tuple[str, ...] = ("chat", "mode", "context", *SETTING_NAMES)


def import_gradio():
    try:
        import gradio  # noqa: PLC0415 (optional extra: app)
    except ImportError as err:
        raise ImportError(
            "Chat-E needs gradio: pip install 'hf-ext[app]' (or pip install 'gradio>=6.31,<7')."
        ) from err
    return gradio


# ---- display <-> model text ----------------------------------------------------------------------------------------


def to_display(text: str) -> str:
    """Text as the chat window shows it: HTML-escaped, so markup and scripts appear as typed. Tabs travel as an entity:
    Gradio's Chatbot passes a message through ``inspect.cleandoc``, which would expand them into spaces, and the reply
    a user saw would no longer be the one stored with their feedback."""
    return html.escape(text, quote=False).replace("\t", "&#9;").replace("\n", "<br>")


def from_display(content: Any) -> str:
    """The inverse of :func:`to_display` for a chat message's content."""
    return html.unescape(message_text(content).replace("<br>", "\n"))


def chat_messages(chat: list | None) -> list[dict]:
    """The chat window's value as plain ``{"role", "content"}`` messages (content as displayed)."""
    return [{"role": m["role"], "content": message_text(m.get("content"))} for m in chat or [] if m.get("role")]


def engine_ranges(engine: ChatEngine) -> dict[str, tuple[float, float]]:
    """The settings' slider ranges, reply lengths up to what the model's position window allows."""
    return setting_ranges(engine.max_positions - 1)


def setting_controls(settings: GenerationSettings, ranges: dict[str, tuple[float, float]]) -> list:
    """One control per declared generation setting, in its order, showing ``settings``: a slider over its range
    (its value brought into it), a checkbox for a bool. Call it inside a ``gr.Blocks``."""
    gr = import_gradio()
    controls = []
    for f in SETTINGS:
        value = getattr(settings, f.name)
        if f.metadata["ui"] is None:
            controls.append(gr.Checkbox(value=bool(value), label=f.name))
            continue
        low, high = ranges[f.name]
        step = f.metadata["ui"][2]
        controls.append(gr.Slider(low, high, value=min(max(value, low), high), step=step, label=f.name))
    return controls


def context_controls(elem_prefix: str = "") -> tuple:
    """The context mode's radio, the context box and its examples, the box fitted to the mode when it changes
    (:meth:`Handlers.mode_changed`): ``(mode, context)``. Call it inside a ``gr.Blocks``; ``elem_prefix`` goes before
    the elements' ids (``mode``, ``context``)."""
    gr = import_gradio()
    mode = gr.Radio(list(UI_MODES), value="persona", label="Context mode", elem_id=f"{elem_prefix}mode")
    context = gr.Textbox(
        value=EXAMPLES["persona"],
        label="Context",
        info=CONTEXT_HINTS["persona"],
        lines=3,
        elem_id=f"{elem_prefix}context",
    )
    gr.Examples(
        examples=[[m, EXAMPLES[m]] for m in EXAMPLES],
        inputs=[mode, context],
        example_labels=[f"{m}: {EXAMPLES[m]}" for m in EXAMPLES],
        label="Context examples",
    )
    mode.change(Handlers.mode_changed, [mode, context], [context], queue=False, api_visibility="undocumented")
    return mode, context


# ---- handlers (plain functions of their inputs: no state is shared between sessions) --------------------------------


def checked_request(limits: ChatLimits, ranges: dict, where: str, **fields) -> Request:
    """:func:`~chat_e.data.limits.check_request` of an event's inputs; a refusal is a ``gr.Error`` with its message
    (and one log line, no traceback)."""
    try:
        return check_request(limits, ranges=ranges, **fields)
    except Refused as err:
        logger.info("refused (%s): %s", where, err)
        raise import_gradio().Error(str(err), title="Chat-E cannot take this", print_exception=False) from None


class Handlers:
    """The UI's event handlers and the ``chat`` API function, over one engine."""

    def __init__(
        self,
        engine: ChatEngine,
        settings: GenerationSettings | None = None,
        limits: ChatLimits | None = None,
        store: FeedbackStore | None = None,
    ):
        self.engine = engine
        self.settings = settings or engine.default_settings()
        self.limits = limits or ChatLimits()
        self.ranges = engine_ranges(engine)
        self.store = store

    def check(self, where: str, **fields) -> Request:
        """:func:`checked_request` under this server's limits and the engine's ranges."""
        return checked_request(self.limits, self.ranges, where, **fields)

    def add_message(self, message: Any, chat: Any):
        """Append the user's message to the chat, clear the box and lock the controls until the reply is done (so a
        session never has two replies under way). A refused message (empty, too long) stays in the box."""
        gr = import_gradio()
        self.refuse_message(message, chat)
        chat = chat_messages(chat)
        chat.append({"role": "user", "content": to_display(message)})
        return gr.update(value="", interactive=False), chat, *[gr.update(interactive=False)] * N_BUTTONS

    def refuse_message(self, message: Any, chat: Any) -> None:
        """Refuse a message :meth:`add_message` cannot take (empty, too long). Alone, it is the page's first step on
        Send, with no outputs, so that a refused message is a toast and marks neither the chat nor the box "Error"
        (a failed event marks its outputs)."""
        self.check("add_message", message=message, chat=chat, text=from_display)

    def respond(self, chat: Any, mode: Any, context: Any, *settings: Any):
        """Stream the bot's reply to the last user message of the chat (nothing to do when there is none);
        ``settings`` are the declared generation settings' values, in their order (:data:`RESPOND_PARAMETERS`)."""
        for shown, _ in self.reply(chat, mode, context, *settings):
            yield shown

    def reply(self, chat: Any, mode: Any, context: Any, *settings: Any, replaced: dict | None = None):
        """:meth:`respond`'s chats, each with the record of the reply once it is complete (None before, and for an
        apology): everything feedback on it needs (:meth:`record`). ``replaced``: the record of the reply this one
        may regenerate; when it answered the same prompt under settings that cannot vary (no sampling: greedy or
        beam search), this reply is sampled (at the settings' temperature and top_p), or it would be the same."""
        pending = isinstance(chat, list) and chat and isinstance(chat[-1], dict) and chat[-1].get("role") == "user"
        if not pending:
            self.check("respond", chat=chat)
            yield chat_messages(chat), None
            return
        checked = self.check(
            "respond",
            message=from_display(chat[-1].get("content")),
            chat=chat[:-1],
            mode=mode,
            context=context,
            settings=dict(zip(SETTING_NAMES, settings, strict=True)),
            defaults=self.settings,
            text=from_display,
        )
        if same_prompt(replaced, checked) and not checked.settings.do_sample:
            checked = checked.but(settings=checked.settings.replace(do_sample=True, num_beams=1))
        chat = chat_messages(chat)
        chat.append({"role": "assistant", "content": ""})
        reply, failed = "", False
        stream = self.engine.stream(checked)
        try:
            for piece in stream:
                reply += piece
                chat[-1]["content"] = to_display(reply)
                yield [dict(m) for m in chat], None
        except BackendError as err:  # the remote server's failure, already one line
            logger.error("generation failed (mode=%s, %d messages): %s", checked.mode, len(checked.history), err)
            chat[-1]["content"] = APOLOGY
            failed = True
        except Exception:
            logger.exception("generation failed (mode=%s, %d messages)", checked.mode, len(checked.history))
            chat[-1]["content"] = APOLOGY
            failed = True
        finally:
            stream.close()
        if not chat[-1]["content"]:
            chat[-1]["content"] = to_display(reply) or EMPTY_REPLY
        yield chat, (None if failed else self.record(checked, reply, stream.model))

    def record(self, checked: Request, reply: str, model: str | None = None) -> dict[str, Any]:
        """A reply and what it was made from, as feedback on it is stored (:class:`chat_e.feedback.store.Feedback`);
        ``model``: the model that made it (the engine's name when None)."""
        return {
            "reply_id": uuid.uuid4().hex,
            "model": model or self.engine.name,
            "mode": checked.mode,
            "context": checked.context or "",
            "history": list(checked.history),
            "message": checked.message,
            "settings": asdict(checked.settings or self.settings),
            "reply": reply,
        }

    def respond_event(self, chat: Any, mode: Any, context: Any, *settings_and_records: Any):
        """:meth:`respond` as the UI's event: the session's reply records (by chat index) come last and go out
        updated. A reply to the same prompt as the one it replaces (a regeneration) remembers it, for :meth:`prefer`."""
        *settings, records = settings_and_records
        records = dict(records or {})
        index = len(chat) if isinstance(chat, list) else None  # where the new reply goes (after the user's message)
        old = records.get(index)  # the reply that was there, when this is a regeneration
        for shown, record in self.reply(chat, mode, context, *settings, replaced=old):
            if record is not None:
                # the choice between the two replies, only when they differ (an equal pair teaches nothing)
                if same_prompt(old, record) and old["reply"] != record["reply"]:
                    record["previous"] = {k: v for k, v in old.items() if k != "previous"}
                records[len(shown) - 1] = record
            yield shown, records

    # ---- feedback ---------------------------------------------------------------------------------------------

    def _store(self, where: str, session: str | None, **row) -> None:
        """Store one feedback row; a failure is one log line and a notice to the user."""
        try:
            self.store.add_feedback(session_id=session or "", **row)
        except Exception:
            logger.exception("could not store feedback (%s)", where)
            raise import_gradio().Error(NOT_SAVED, title="Not saved", print_exception=False) from None

    def _record(self, records: dict | None, index: Any) -> dict:
        record = (records or {}).get(index) if isinstance(index, int) and not isinstance(index, bool) else None
        if record is None:
            raise import_gradio().Error(
                f"There is no reply of this chat's at index {index!r} to give feedback on: rate one of the bot's "
                "replies (the chat window's index of an assistant message).",
                title="Chat-E cannot take this",
                print_exception=False,
            )
        return record

    @staticmethod
    def _exchange(record: dict) -> dict:
        keys = ("reply_id", "model", "mode", "context", "history", "message", "settings", "reply")
        return {k: record[k] for k in keys}

    def rate(self, index: Any, rating: Any, records: dict | None, session: str | None = None) -> dict:
        """Store a rating of the reply at chat ``index``: ``like``, ``dislike`` or ``none`` (taken back). The records
        go out with the rating beside the reply, so that the chat window keeps showing it (:func:`shown_ratings`)."""
        if rating not in RATINGS:
            raise import_gradio().Error(
                f"A rating is one of {', '.join(RATINGS)}, not {rating!r}.", print_exception=False
            )
        index = int(index) if isinstance(index, float) and index.is_integer() else index
        record = self._record(records, index)
        self._store("rate", session, kind="rating", rating=RATINGS[rating], **self._exchange(record))
        return {**records, index: {**record, SHOWN_RATING: FEEDBACK_OPTIONS.get(rating)}}

    def correct(self, text: Any, records: dict | None, session: str | None = None):
        """Store ``text`` as what the bot should have said instead of its newest reply; clears the box."""
        gr = import_gradio()
        if not records:
            raise gr.Error("There is no reply to correct yet.", print_exception=False)
        checked = self.check("correct", message=text)
        record = records[max(records)]
        self._store("correct", session, kind="edit", edited=checked.message, **self._exchange(record))
        gr.Info("Thanks: your correction is saved.")
        return ""

    def prefer(self, which: Any, records: dict | None, session: str | None = None) -> None:
        """Store the choice between the newest reply and the one it regenerated: ``which`` is
        :data:`PREVIOUS_REPLY` or :data:`NEW_REPLY`."""
        gr = import_gradio()
        record = records[max(records)] if records else None
        if record is None or "previous" not in record:
            raise gr.Error(
                "There is no regenerated reply to compare yet: press Regenerate first.", print_exception=False
            )
        if which not in (PREVIOUS_REPLY, NEW_REPLY):
            raise gr.Error(f"Choose {PREVIOUS_REPLY!r} or {NEW_REPLY!r}, not {which!r}.", print_exception=False)
        chosen, other = (record, record["previous"]) if which == NEW_REPLY else (record["previous"], record)
        self._store(
            "prefer",
            session,
            kind="choice",
            other_reply_id=other["reply_id"],
            other_reply=other["reply"],
            **self._exchange(chosen),
        )
        gr.Info("Thanks: your choice is saved.")

    @staticmethod
    def continue_from(which: Any, chat: list | None, records: dict | None) -> tuple[list[dict], dict]:
        """The chat and its records going on from the reply chosen: the previous reply (chosen over its
        regeneration) takes the newest reply's place; a new reply chosen leaves both as they are."""
        records = dict(records or {})
        chat = chat_messages(chat)
        index = max(records) if records else None
        if which != PREVIOUS_REPLY or index is None or "previous" not in records[index] or index >= len(chat):
            return chat, records
        previous = records[index]["previous"]
        chat[index]["content"] = to_display(previous["reply"]) or EMPTY_REPLY
        records[index] = previous
        return chat, records

    @staticmethod
    def regenerate(chat: list | None) -> list[dict]:
        """Drop the bot's last reply so that :meth:`respond` answers the last user message again."""
        chat = chat_messages(chat)
        while chat and chat[-1]["role"] != "user":
            chat.pop()
        return chat

    @staticmethod
    def undo(chat: list | None):
        """Remove the last exchange and put the user's message back in the box."""
        chat = chat_messages(chat)
        while chat and chat[-1]["role"] != "user":
            chat.pop()
        message = from_display(chat.pop()["content"]) if chat else ""
        return chat, message

    @staticmethod
    def clear():
        return [], ""

    @staticmethod
    def mode_changed(mode: str, context: str | None):
        """Fit the context box to the mode: free chat has none; an empty box or another mode's example gets this
        mode's example."""
        gr = import_gradio()
        if mode == "free":
            return gr.update(value="", interactive=False, info=CONTEXT_HINTS["free"])
        value = context or ""
        if not value.strip() or value in EXAMPLES.values():
            value = EXAMPLES.get(mode, "")
        return gr.update(value=value, interactive=True, info=CONTEXT_HINTS.get(mode, ""))

    def api_chat(self, message: str, history: list[dict], mode: str, context: str) -> str:
        """Chat-E's reply to ``message``.

        Args:
            message: the user's newest message (non-empty; an empty or over-long one is refused).
            history: the conversation so far, oldest first, as ``{"role": "user" | "assistant", "content": str}``.
            mode: ``persona``, ``emotion``, ``domain``, ``topic`` or ``free``.
            context: the persona sentences, emotion, domain or topic (ignored in free chat).
        """
        checked = self.check("chat", message=message, history=history, mode=mode, context=context)
        try:
            return self.engine.reply(checked.but(settings=self.settings)).text
        except BackendError as err:  # the remote server's failure, already one line
            logger.error("generation failed (api, mode=%s, %d messages): %s", checked.mode, len(checked.history), err)
            return APOLOGY
        except Exception:
            logger.exception("generation failed (api, mode=%s, %d messages)", checked.mode, len(checked.history))
            return APOLOGY


# ---- layout ----------------------------------------------------------------------------------------------------


def build_app(  # long: a Blocks layout, in the page's order
    engine: ChatEngine,
    settings: GenerationSettings | None = None,
    concurrency_limit: int = 2,
    limits: ChatLimits | None = None,
    store: FeedbackStore | None = None,
):
    """The Chat-E Blocks for ``engine``; ``settings`` are the defaults shown in the settings accordion and used by
    the ``chat`` API endpoint. Generation runs at most ``concurrency_limit`` at a time, and at most
    ``limits.max_queue`` requests wait; every request is checked against ``limits``. With a feedback ``store``, every
    reply gets thumbs, the newest a correction box, and a regenerated one the choice between it and the previous
    (each stored with the exchange it is about; also the ``rate``, ``correct`` and ``prefer`` endpoints)."""
    gr = import_gradio()
    handlers = Handlers(engine, settings, limits, store)
    s = handlers.settings
    ranges = handlers.ranges
    generate = dict(concurrency_limit=concurrency_limit, concurrency_id=GENERATE_GROUP)
    ui = dict(api_visibility="undocumented")
    raw = dict(preprocess=False)  # the handler checks its inputs itself (check_request)

    def unlock():
        return [gr.update(interactive=True)] * (1 + N_BUTTONS)

    def lock():
        return [gr.update(interactive=False)] * (1 + N_BUTTONS)

    with gr.Blocks(title=TITLE, analytics_enabled=False) as demo:
        gr.Markdown(f"# {TITLE}")
        gr.Markdown(
            "A dialogue model fine-tuned with hf-ext. Give it a persona, an emotion, a domain or a topic, or chat "
            "freely.",
        )
        model_line = gr.Markdown(f"**Model:** `{engine.describe()}`", elem_id="model-line")
        # the served model can change while the server runs (the Train page's Promote): each page load says which
        demo.load(lambda: f"**Model:** `{engine.describe()}`", None, model_line, queue=False, **ui)
        with gr.Row():
            with gr.Column(scale=1, min_width=260):
                mode, context = context_controls()
                with gr.Accordion("Generation settings", open=False, elem_id="settings"):
                    gr.Markdown("Replies stream token by token with 1 beam; beam search shows them when done.")
                    settings_controls = setting_controls(s, ranges)
            with gr.Column(scale=3):
                chatbot = gr.Chatbot(
                    label=TITLE,
                    elem_id="chatbot",
                    height=460,
                    render_markdown=False,
                    feedback_options=tuple(FEEDBACK_OPTIONS.values()) if store else None,
                    buttons=["copy", "copy_all"],
                    placeholder="Pick a context on the left, then say hello.",
                )
                chatbot.data_model = checked_chat_model(type(chatbot).data_model)
                message, send = message_row(gr, "Type a message and press Enter", "message", "send")
                with gr.Row():
                    regenerate = gr.Button("Regenerate", size="sm", elem_id="regenerate")
                    undo = gr.Button("Undo", size="sm", elem_id="undo")
                    clear = gr.Button("Clear", size="sm", elem_id="clear")
                records = gr.State({})  # the session's replies by chat index, with what they were made from
                if store:
                    feedback = FeedbackControls(handlers, chatbot, records)

        reply_inputs = [chatbot, mode, context, *settings_controls, records]
        respond = named(handlers.respond_event, (*RESPOND_PARAMETERS, "records"))
        buttons = [send, regenerate, undo, clear]
        assert len(buttons) == N_BUTTONS
        replied = (
            gr.on([message.submit, send.click], handlers.refuse_message, [message, chatbot], None, **raw, **ui)
            .success(
                handlers.add_message,
                [message, chatbot],
                [message, chatbot, *buttons],
                queue=False,
                api_name="add_message",
                **raw,
                **ui,
            )
            .then(respond, reply_inputs, [chatbot, records], api_name="respond", **raw, **generate, **ui)
        )
        replied.then(unlock, None, [message, *buttons], queue=False, **ui)
        regenerated = (
            gr.on([regenerate.click], lock, None, [message, *buttons], queue=False, **ui)
            .then(handlers.regenerate, [chatbot], [chatbot], queue=False, **ui)
            .then(respond, reply_inputs, [chatbot, records], **raw, **generate, **ui)
        )
        regenerated.then(unlock, None, [message, *buttons], queue=False, **ui)
        undone = gr.on([undo.click], handlers.undo, [chatbot], [chatbot, message], queue=False, **ui)
        if store:
            regenerated.then(feedback.offer_choice, [records], [feedback.prefer], queue=False, **ui)
            # the window forgets its thumbs when its messages change: every rating stays shown
            for changed in (replied, regenerated, undone):
                changed.then(shown_ratings, [chatbot, records], [chatbot], queue=False, **ui)
        clear.click(handlers.clear, None, [chatbot, message], queue=False, **ui)
        chatbot.clear(lambda: "", None, [message], queue=False, **ui)
        gr.api(typed(handlers.api_chat), api_name="chat", **generate)

    demo.queue(default_concurrency_limit=concurrency_limit, max_size=handlers.limits.max_queue)
    return demo


def shown_ratings(chat: list | None, records: dict | None):
    """The chat window's thumbs as the session gave them: one per assistant message, in order (Gradio's
    ``feedback_value``), from the ratings its reply records keep."""
    records = records or {}
    shown = [
        (records.get(i) or {}).get(SHOWN_RATING) for i, m in enumerate(chat_messages(chat)) if m["role"] == "assistant"
    ]
    return import_gradio().update(feedback_value=shown)


class FeedbackControls:
    """The feedback controls under the chat window, wired to ``handlers`` (call it inside a ``gr.Blocks``): thumbs
    on every reply (Gradio's like event), a correction box for the newest reply, the choice after a regeneration,
    and a note saying what is stored. Programs use the ``rate``, ``correct`` and ``prefer`` endpoints."""

    def __init__(self, handlers: Handlers, chatbot, records):
        gr = import_gradio()
        self.prefer = gr.Radio(
            [PREVIOUS_REPLY, NEW_REPLY], label="Which reply is better?", visible=False, elem_id="prefer"
        )
        with gr.Row():
            correction = gr.Textbox(
                show_label=False,
                placeholder="What should it have said? (corrects the newest reply)",
                scale=6,
                elem_id="correction",
            )
            save = gr.Button("Save correction", size="sm", scale=1, min_width=80, elem_id="save-correction")
        gr.Markdown(
            "Thumbs, corrections and choices are stored with the chat they are about, to train Chat-E on.",
            elem_id="feedback-note",
        )
        # the rate endpoint's inputs (the like event carries its own): a program names the reply by its chat index
        index = gr.Number(visible=False, precision=0)
        rating = gr.Textbox(visible=False)
        rate = gr.Button(visible=False)

        def on_like(records, data, request):
            liked = "like" if data.liked is True else "dislike" if data.liked is False else "none"
            records = handlers.rate(data.index, liked, records, request.session_hash)
            gr.Info(RATED[liked])
            return records

        def on_rate(index, rating, records, request):
            handlers.rate(index, rating, records, request.session_hash)

        def on_correct(text, records, request):
            return handlers.correct(text, records, request.session_hash)

        def on_prefer(which, records, chat, request):
            handlers.prefer(which, records, request.session_hash)
            chat, records = handlers.continue_from(which, chat, records)
            return gr.update(visible=False), chat, records

        on_like.__annotations__ = {"data": gr.LikeData, "request": gr.Request}
        for fn in (on_rate, on_correct, on_prefer):
            fn.__annotations__ = {"request": gr.Request}
        # queued, as the correction: a toast reaches the page through the queue only
        chatbot.like(on_like, [records], [records], api_visibility="undocumented")
        rate.click(on_rate, [index, rating, records], None, queue=False, api_name="rate")
        gr.on(
            [save.click, correction.submit],
            on_correct,
            [correction, records],
            [correction],
            api_name="correct",
            show_progress="hidden",
        )
        self.prefer.input(
            on_prefer, [self.prefer, records, chatbot], [self.prefer, chatbot, records], queue=False, api_name="prefer"
        ).then(shown_ratings, [chatbot, records], [chatbot], queue=False, api_visibility="undocumented")

    @staticmethod
    def offer_choice(records):
        """Show the choice, with both replies' text, when the newest reply is a regeneration."""
        newest = records[max(records)] if records else {}
        if "previous" not in newest:
            return import_gradio().update(visible=False, value=None)
        shown = [
            (f"{label}: {_clip(reply)}", label)
            for label, reply in ((PREVIOUS_REPLY, newest["previous"]["reply"]), (NEW_REPLY, newest["reply"]))
        ]
        return import_gradio().update(visible=True, value=None, choices=shown)


#: how much of a reply the choice after a regeneration shows
CHOICE_CHARS = 300


def _clip(text: str) -> str:
    text = " ".join(text.split()) or EMPTY_REPLY
    return text if len(text) <= CHOICE_CHARS else text[: CHOICE_CHARS - 1] + "…"


def message_row(gr, placeholder: str, box_id: str, button_id: str):
    """A row with the message box and its Send button (the chat's and the arena's)."""
    with gr.Row():
        box = gr.Textbox(show_label=False, placeholder=placeholder, scale=6, autofocus=True, elem_id=box_id)
        send = gr.Button("Send", variant="primary", scale=1, min_width=80, elem_id=button_id)
    return box, send


def same_prompt(record: dict | None, other) -> bool:
    """Whether a reply ``record`` answered the prompt of ``other`` (a record, or a checked request)."""
    if record is None:
        return False
    get = other.get if isinstance(other, dict) else lambda key: getattr(other, key)
    return (record["message"], record["history"], record["mode"], record["context"]) == (
        get("message"),
        list(get("history")),
        get("mode"),
        get("context") or "",
    )


def checked_chat_model(model):
    """The chat window's data model (``model``), its refusal of a malformed chat a ``gr.Error`` that says what a chat
    is. Gradio checks a chat against it before any handler runs (``preprocess=False`` included)."""

    class CheckedChat(model):
        @classmethod
        def model_validate(cls, obj, *args, **kwargs):
            try:
                return super().model_validate(obj, *args, **kwargs)
            except pydantic.ValidationError:
                message = (
                    "The chat should be the chat window's value: a list of {'role': 'user' | 'assistant', "
                    "'content': [{'type': 'text', 'text': ...}]} messages."
                )
                logger.info("refused (chat window): %s", message)
                raise import_gradio().Error(message, title="Chat-E cannot take this", print_exception=False) from None

    CheckedChat.__name__ = model.__name__
    return CheckedChat


def named(generator, parameters: tuple[str, ...]):
    """``generator`` (a generator function taking ``*args``) with ``parameters`` as its signature, so Gradio names
    the endpoint's parameters (and still streams it)."""

    @functools.wraps(generator)
    def call(*args):
        yield from generator(*args)

    call.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in parameters]
    )
    return call


def typed(method):
    """``method`` with its annotations evaluated (this module's are strings), for gradio's API schema."""

    @functools.wraps(method)
    def call(*args, **kwargs):
        return method(*args, **kwargs)

    call.__signature__ = inspect.signature(method, eval_str=True)
    return call


def theme():
    """Gradio's default look with the system's fonts, so the page makes no request outside this server."""
    gr = import_gradio()
    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    return gr.themes.Default(font=system, font_mono=["ui-monospace", "monospace"])
