"""Where execute_fails's helper mode fails: two calls deep, in numpy."""

import numpy as np


def work():
    return reshape()


def reshape():
    return np.ones(3).reshape(7)
