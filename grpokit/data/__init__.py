"""Datasets: ``loading`` turns ``--dataset`` specs into normalised rows; ``builtin`` generates the built-in tasks;
``hub`` loads Hugging Face Hub datasets and fails fast offline. Importing this package loads nothing heavy."""
