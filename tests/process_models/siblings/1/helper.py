"""A sibling of model.py."""


def offset(values):
    return values + 1
