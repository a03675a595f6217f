"""Planner tests: pure planning over graphs stored as data, no Keras.

Nothing here (nor in the tests of this folder) imports Keras or a backend:
`pytest tests/planner` runs where no backend is installed.
"""
