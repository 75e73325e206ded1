"""``optbench validate``: baseline against the furthest phase that runs here, judged by the plan's
gates (``claims`` holds the plan's numbers, cited once); ``api`` is the validation, ``command``
its options and output."""
