"""What Chat-E's users said, kept: the feedback database (``store``, its schema versions in ``migrations``), the
training rows made from it (``export``, ``cli``) and the arena's ranking (``leaderboard``). Imports neither the web
UI nor the HTTP API."""
