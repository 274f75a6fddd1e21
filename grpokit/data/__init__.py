"""Datasets: ``loading`` turns ``--dataset`` specs into normalised rows; ``columns`` (``--columns`` and ms-swift's
column aliases) and ``rows`` (rows → a ``messages`` prompt) normalise them; ``builtin`` generates the built-in tasks;
``hub`` loads Hugging Face Hub datasets and fails fast offline. Importing this package loads nothing heavy."""
