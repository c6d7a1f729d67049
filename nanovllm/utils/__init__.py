"""Small helpers shared across the package (the modules here hold the larger ones)."""


def is_int(value: object) -> bool:
    """An int that is not a bool (to Python True is the int 1; no count or id here is)."""
    return isinstance(value, int) and not isinstance(value, bool)


def sum_lists(lists) -> list:
    """Element-wise sums of number lists of any lengths (each as if padded with zeros)."""
    total: list = []
    for values in lists:
        total += [0] * (len(values) - len(total))
        for i, value in enumerate(values):
            total[i] += value
    return total
