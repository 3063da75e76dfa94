"""Chat-E's training, installed: the dialogue fine-tune (SFT, ``dialogue``) and preference tuning (DPO/KTO,
``preference``) that ``recipes/blenderbot.py`` and ``recipes/preference.py`` run, and ``chat-e train`` (``launch``),
which runs either under a launcher without a clone. Imports the data layer only."""
