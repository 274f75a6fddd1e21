"""Datasets: ``loading`` turns ``--dataset`` specs into normalised rows; ``columns`` (``--columns`` and ms-swift's
column aliases) and ``rows`` (rows → a ``messages`` prompt) normalise them; ``builtin`` generates the built-in tasks;
``hub`` loads Hugging Face Hub datasets and fails fast offline. Importing this package loads nothing heavy."""

# A hidden row column set by ``rows.normalize_rows``: True where the row's prompt came as a list of messages
# (TRL's conversational format), False for a prompt string (TRL's standard format). Reward functions called
# TRL's way read it (``grpokit.rewards.calling``); no reward sees it as a column.
CONVERSATIONAL_COLUMN = "_conversational"
