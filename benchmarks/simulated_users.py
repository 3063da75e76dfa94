"""A seeded population of scripted Chat-E users with stated, checkable preferences, who use a running Chat-E through
its real surface (``gradio_client`` on the chat UI, the arena and the Train page), as people would.

Every user has a persona (a name and a hobby: ``My name is Ava. I love hiking.``, chatted with in Chat-E's persona
mode) and one **preference**, checked by rule (:func:`satisfies`, with :mod:`chat_e.data.adherence`'s checkers):

* a short reply: at most :data:`MAX_WORDS` words;
* that ends with a question, keeping the chat going;
* that, asked the persona's name or hobby, says it.

Giving feedback (:func:`give_feedback`), each user opens one session and sends first messages drawn from
:data:`FEEDBACK_MESSAGES`: a thumb up for a reply that meets the preference and down for one that does not, then a
correction built by rule (:meth:`User.correction`, a reply that meets it); every other message the user also presses
Regenerate (a sampled reply) and, when the two replies differ in how well they meet the preference
(:meth:`User.score`), chooses the better. Voting (:func:`vote_in_arena`), each user sends messages of
:data:`HELD_OUT_MESSAGES` -- none of them ever used for feedback -- to the arena's blind pair and votes for the reply
that meets more of the preference (``tie`` when both meet all of it, ``bothbad`` when they meet equally little).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chat_e.data.adherence import ends_with_question, keeps_context, max_words, persona_fact

#: the preference's length limit, in words
MAX_WORDS = 20
NAMES = ("Ava", "Ben", "Chloe", "Diego", "Emma", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Kira", "Leo", "Maya",
         "Nils", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Vera", "Will", "Yara")  # fmt: skip
#: hobby -> the words that name it in a reply
HOBBIES = {
    "hiking": ("hiking", "hike", "hikes"),
    "painting": ("painting", "paint", "paints"),
    "chess": ("chess",),
    "baking": ("baking", "bake", "bakes", "bread"),
    "fishing": ("fishing", "fish"),
    "the guitar": ("guitar", "guitars"),
    "gardening": ("gardening", "garden", "plants"),
    "swimming": ("swimming", "swim", "swims"),
}
NAME, HOBBY, CHAT = "name", "hobby", "chat"


@dataclass(frozen=True)
class Message:
    """A user's first message and what it asks: the persona's ``name``, its ``hobby``, or nothing in particular."""

    text: str
    asks: str = CHAT


#: the messages feedback is given on
FEEDBACK_MESSAGES = (
    Message("What's your name?", NAME), Message("Who am I talking to?", NAME), Message("Can I ask your name?", NAME),
    Message("What do you like to do for fun?", HOBBY), Message("What's your favorite hobby?", HOBBY),
    Message("How do you spend your free time?", HOBBY),
    Message("How was your day?"), Message("I just got home from work."), Message("Any plans for the weekend?"),
    Message("I'm thinking of getting a pet."), Message("What did you have for dinner?"),
    Message("It's raining again here."), Message("I can't sleep tonight."), Message("I started a new job today."),
)  # fmt: skip
#: the messages of the blind votes: never used for feedback
HELD_OUT_MESSAGES = (
    Message("Sorry, what was your name again?", NAME), Message("May I ask who you are?", NAME),
    Message("What keeps you busy when you're not working?", HOBBY), Message("Got any hobbies?", HOBBY),
    Message("I finally finished my book."), Message("Do you like coffee?"), Message("What's new with you?"),
    Message("I had a long week."), Message("The weather is lovely today."), Message("I'm cooking pasta tonight."),
)  # fmt: skip
ACKS = ("That sounds nice.", "Oh, I see.", "Good to hear.", "Fair enough.", "Me too, honestly.", "I hear you.")
QUESTIONS = ("How about you?", "What about you?", "What do you think?", "How are you feeling?", "Tell me more?")


@dataclass(frozen=True)
class User:
    """A simulated user: a persona and the preference of the module docstring."""

    id: int
    name: str
    hobby: str

    @property
    def persona(self) -> str:
        """The persona mode's context."""
        return f"My name is {self.name}. I love {self.hobby}."

    def criteria(self, message: Message, reply: str) -> list[bool]:
        """Each part of the preference: short, ends with a question, and (when asked) the persona's fact."""
        parts = [max_words(reply, n=MAX_WORDS) and bool(reply.strip()), ends_with_question(reply)]
        if message.asks == NAME:
            parts.append(persona_fact(reply, name=self.name, hobby=()))
        elif message.asks == HOBBY:
            parts.append(keeps_context(reply, keywords=HOBBIES[self.hobby]))
        return parts

    def score(self, message: Message, reply: str) -> int:
        """How many parts of the preference ``reply`` meets."""
        return sum(self.criteria(message, reply))

    def correction(self, message: Message, rng: random.Random) -> str:
        """What the bot should have said: a reply built by rule that meets the preference."""
        question = rng.choice(QUESTIONS)
        if message.asks == NAME:
            return f"I'm {self.name}! {question}"
        if message.asks == HOBBY:
            return f"I love {self.hobby}. {question}"
        return f"{rng.choice(ACKS)} {question}"


def satisfies(user: User, message: Message, reply: str) -> bool:
    """Whether ``reply`` to ``message`` meets all of ``user``'s preference."""
    return all(user.criteria(message, reply))


def population(n: int, seed: int = 0) -> list[User]:
    """``n`` users with seeded names and hobbies (the names distinct while :data:`NAMES` lasts)."""
    rng = random.Random(seed)
    names = rng.sample(NAMES, min(n, len(NAMES))) + [rng.choice(NAMES) for _ in range(n - len(NAMES))]
    return [User(i, names[i], rng.choice(sorted(HOBBIES))) for i in range(n)]


# ---------------------------------------------------------------------------------------------- the chat UI
#: the chat UI's ``respond`` settings (the declared generation settings, in order): the served model's greedy reply,
#: and Regenerate's sampled one
GREEDY = (1, False, 1.0, 1.0, 48, 0)
SAMPLED = (1, True, 0.9, 0.95, 48, 0)


def shown_reply(message: dict) -> str:
    """The reply a chat window shows, as the model said it (an empty reply is shown as a placeholder)."""
    from chat_e.web.ui import EMPTY_REPLY, from_display  # noqa: PLC0415 (the app extra)

    text = from_display(message["content"])
    return "" if text == EMPTY_REPLY else text


def _client(url: str, **kwargs):
    from gradio_client import Client  # noqa: PLC0415 (gradio's client: the app extra)

    return Client(url, verbose=False, analytics_enabled=False, ssl_verify=False, **kwargs)


def give_feedback(url: str, users: list[User], messages_per_user: int, seed: int = 0) -> list[dict]:
    """Each user's session on the chat UI at ``url``: ``messages_per_user`` first messages with ratings, corrections,
    and a regeneration choice on every other one (module docstring). Returns what each user sent, in order: one
    ``{"kind", "session_id", "message", ...}`` per piece of feedback the server acknowledged."""
    from chat_e.web.ui import NEW_REPLY, PREVIOUS_REPLY  # noqa: PLC0415 (the app extra)

    rng = random.Random(seed)
    sent = []
    for user in users:
        client = _client(url)
        session = client.session_hash
        for i, message in enumerate(rng.sample(FEEDBACK_MESSAGES, messages_per_user)):
            _, chat, *_ = client.predict(message.text, [], api_name="/add_message")
            chat = client.predict(chat, "persona", user.persona, *GREEDY, api_name="/respond")
            reply = shown_reply(chat[-1])
            liked = satisfies(user, message, reply)
            client.predict(len(chat) - 1, "like" if liked else "dislike", api_name="/rate")
            sent.append({"kind": "rating", "session_id": session, "message": message.text, "reply": reply,
                         "rating": 1 if liked else -1})  # fmt: skip
            if not liked:
                edited = user.correction(message, rng)
                client.predict(edited, api_name="/correct")
                sent.append({"kind": "edit", "session_id": session, "message": message.text, "reply": reply,
                             "edited": edited})  # fmt: skip
            if i % 2:
                again = client.predict(chat[:-1], "persona", user.persona, *SAMPLED, api_name="/respond")
                new = shown_reply(again[-1])
                old_score, new_score = user.score(message, reply), user.score(message, new)
                if new != reply and old_score != new_score:
                    which = NEW_REPLY if new_score > old_score else PREVIOUS_REPLY
                    client.predict(which, api_name="/prefer")
                    chosen, other = (new, reply) if which == NEW_REPLY else (reply, new)
                    sent.append({"kind": "choice", "session_id": session, "message": message.text,
                                 "reply": chosen, "other_reply": other})  # fmt: skip
        client.close()
    return sent


def vote_in_arena(url: str, users: list[User], messages_per_user: int, seed: int = 0) -> list[str]:
    """Each user's blind battles on the arena at ``url`` (its ``/arena/``): ``messages_per_user`` messages of
    :data:`HELD_OUT_MESSAGES` each, a vote on each by the preference. Returns the winners voted, in order."""
    rng = random.Random(seed)
    winners = []
    for user in users:
        client = _client(f"{url}arena/")
        for message in rng.sample(HELD_OUT_MESSAGES, messages_per_user):
            client.predict(api_name="/new_battle")
            _, chat_a, chat_b = client.predict(message.text, "persona", user.persona, api_name="/battle")
            a, b = (shown_reply(chat[-1]) for chat in (chat_a, chat_b))
            score_a, score_b = user.score(message, a), user.score(message, b)
            if score_a != score_b:
                winner = "model_a" if score_a > score_b else "model_b"
            else:
                winner = "tie" if satisfies(user, message, a) else "bothbad"
            client.predict(winner, api_name="/vote")
            winners.append(winner)
        client.close()
    return winners
