"""The prompt-grounded workloads of `python -m bench spec` (bench/inproc/spec.py): generated, deterministic user
messages whose answers repeat long spans of the prompt, which is what speculation drafts from (issue
25). Plain Python: message i is a function of i alone, so every run and machine sees the same text.

- `code-edit`: "rename this variable in the following function", a generated 9-line Python function;
  the answer is the function again with one name changed.
- `summarise`: summarise a generated incident report of 8 sentences in 3 sentences, each with a
  verbatim quote from the report in double quotes.
- `rag`: answer a question from a given passage (10 generated facts about towns), quoting the sentence
  that supports the answer.
"""

from __future__ import annotations

from collections.abc import Callable

NAMES = ["total", "count", "value", "result", "items", "buffer", "offset", "index", "score", "width"]
OPS = ["+", "-", "*"]

SYSTEMS = ["the billing service", "the search index", "the upload queue", "the login page", "the nightly export",
           "the payment gateway", "the cache cluster", "the mobile app", "the report builder", "the mail relay"]  # fmt: skip
CAUSES = ["an expired certificate", "a full disk", "a bad configuration push", "a slow database query",
          "a memory leak", "a network partition", "a missing index", "a retry storm"]  # fmt: skip
TEAMS = ["platform", "storage", "payments", "identity", "mobile", "data"]

TOWNS = ["Alder Bay", "Brookfield", "Cedar Falls", "Dunmore", "Eastwick", "Fairhaven", "Glenrock", "Harwood",
         "Ivybridge", "Juniper Hill", "Kestrel Point", "Lowmoor", "Millbrook", "Northcliff", "Oakridge",
         "Pinecrest", "Queensford", "Redwater", "Stonehaven", "Thornbury"]  # fmt: skip
PRODUCTS = ["wool", "cider", "timber", "cheese", "glass", "rope", "honey", "salt", "paper", "copper"]


def code_edit(i: int) -> str:
    a, b, c = NAMES[i % 10], NAMES[(i + 3) % 10], NAMES[(i + 6) % 10]
    op = OPS[i % 3]
    body = "\n".join([
        f"def update_{a}_{i}({a}, {b}, limit={i + 3}):",
        f"    {c} = []",
        "    for step in range(limit):",
        f"        {a} = {a} {op} step",
        f"        if {a} > {b}:",
        f"            {c}.append({a})",
        "        else:",
        f"            {b} = {b} {op} {a}",
        f"    return {c}, {a}, {b}",
    ])  # fmt: skip
    return (f"Rename the variable `{a}` to `new_{a}` in the following function. Output only the whole "
            f"function, changed.\n\n```python\n{body}\n```")  # fmt: skip


def summarise(i: int) -> str:
    system, cause = SYSTEMS[i % 10], CAUSES[(i * 3) % 8]
    team, other = TEAMS[i % 6], TEAMS[(i + 2) % 6]
    start, minutes = 8 + i % 10, 12 + 7 * (i % 9)
    users = 150 * (i + 3)
    report = " ".join([
        f"At {start:02d}:14 UTC the on-call engineer of the {team} team was paged because {system} returned errors.",
        f"About {users} users saw failed requests during the first {minutes} minutes.",
        f"The first suspect was a deploy of {system} from the previous evening, which was rolled back at {start:02d}:31.",
        f"Errors continued after the rollback, so the {other} team was asked to join the investigation.",
        f"The {other} team found that the real cause was {cause} on the hosts behind {system}.",
        f"Once {cause} was fixed, error rates returned to normal within {minutes // 3 + 2} minutes.",
        f"The {team} team will add an alert that fires when {cause} is detected again.",
        f"A follow-up review of {system} is scheduled for next week with both teams.",
    ])  # fmt: skip
    return ("Summarise the following incident report in three sentences. Each sentence must include one "
            f"exact quote from the report in double quotes.\n\nReport:\n{report}")  # fmt: skip


def rag(i: int) -> str:
    facts = []
    for j in range(10):
        t = (i * 7 + j * 3) % 20
        town, product = TOWNS[t], PRODUCTS[(t + j) % 10]
        mix = (i * 131 + j * 37 + t * 11) % 997  # a fixed scramble: varied figures, no RNG
        people, founded = 1200 + 97 * mix, 1650 + mix % 300
        facts.append(f"{town} was founded in {founded}, has {people} inhabitants and is known for its {product}.")
    asked = facts[(i * 3) % 10].split(" was founded")[0]
    question = ["When was {} founded?", "How many people live in {}?", "What is {} known for?"][i % 3].format(asked)
    return ("Answer the question using only the passage below. Quote the sentence of the passage that "
            f"supports your answer, then give the answer.\n\nPassage:\n{' '.join(facts)}\n\nQuestion: {question}")  # fmt: skip


# workload name -> message i; `random` (random token prompts, no chat) is bench/inproc/spec.py's own
CHAT_WORKLOADS: dict[str, Callable[[int], str]] = {"code-edit": code_edit, "summarise": summarise, "rag": rag}
