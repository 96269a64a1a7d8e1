"""Prompt kinds for the engine benchmarks, written for this project (no download)."""

PASSAGE = (
    "The Riverside Community Library will close for renovation from March 3 to April 18. "
    "During the closure, borrowed items may be returned to the drop box at the Elm Street entrance, "
    "and no late fees will be charged. The reading room on the second floor will get new lighting, "
    "and the children's section will move to the ground floor next to the main desk. "
    "Library cards issued before January 2020 must be renewed at the reopening, free of charge. "
    "The book sale planned for March 10 is postponed to April 26 and will be held in the courtyard."
)

KINDS: dict[str, list[str]] = {
    "code": [
        "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
        "Write a Python class Stack with push, pop, peek and is_empty methods.",
    ],
    "chat": [
        "Explain in a few sentences why the sky is blue.",
        "Give me three tips for sleeping better.",
    ],
    "extraction": [
        f"Here is a notice:\n\n{PASSAGE}\n\nRepeat the notice word for word, then list its dates.",
        f"Text:\n{PASSAGE}\n\nCopy every sentence of the text that mentions a date, exactly as written.",
    ],
}
