"""Stage flag lists as the lanes change them: split into flags by the flag schema, one flag replaced by another.

A lane's change to a stage replaces that flag in the base run's list (every value of it, so a lane's --dataset
names all the files it reads); the flags it does not name stay as the base run gives them.
"""
from __future__ import annotations

from eagle3_pipeline.errors import UsageError
from eagle3_pipeline.cli.flags import FLAGS, STAGE_FLAGS, all_option_strings

Item = tuple[str, list[str]]  # (the flag as written, its value: [] for a switch, [value] otherwise)


def canonical(name: str) -> str:
    """The schema's name of a flag (--lr for --learning-rate); a flag outside the schema is its own name."""
    return all_option_strings().get(name, name)


def takes_value(name: str) -> bool | None:
    """Whether the schema says the flag takes a value; None for a flag outside it (scripts/ have their own)."""
    flag = FLAGS.get(canonical(name))
    return None if flag is None else flag.action != "store_true"


def split_flags(argv: list[str]) -> list[Item]:
    """argv as (flag, value) items, `--flag=value` included. A flag outside the schema takes the next token as
    its value unless that token is itself a flag."""
    items, i = [], 0
    while i < len(argv):
        name, equals, inline = argv[i].partition("=")
        if not name.startswith("-"):
            raise UsageError(f"unexpected argument {argv[i]!r} among the flags {' '.join(argv)}: every value follows "
                             f"its --flag")
        wants = takes_value(name)
        if equals:
            items.append((name, [inline]))
            i += 1
        elif wants or (wants is None and i + 1 < len(argv) and not argv[i + 1].startswith("--")):
            if i + 1 >= len(argv):
                raise UsageError(f"{name} needs a value")
            items.append((name, [argv[i + 1]]))
            i += 2
        else:
            items.append((name, []))
            i += 1
    return items


def join_flags(items: list[Item]) -> list[str]:
    return [token for name, value in items for token in (name, *value)]


def merged(base: list[str], changes: list[str]) -> list[str]:
    """The base flags with every flag that `changes` names replaced by the changes' values, which come last."""
    changed = {canonical(name) for name, _ in split_flags(changes)}
    kept = [(name, value) for name, value in split_flags(base) if canonical(name) not in changed]
    return join_flags(kept) + list(changes)


def last_value(argv: list[str], name: str) -> str | None:
    """The value the stage would read for flag `name` (its last occurrence, any spelling), or None if absent."""
    values = [value[0] for flag, value in split_flags(argv) if canonical(flag) == name and value]
    return values[-1] if values else None


def all_values(argv: list[str], name: str) -> list[str]:
    """Every value of a repeatable flag (--dataset), in order."""
    return [value[0] for flag, value in split_flags(argv) if canonical(flag) == name and value]


def has_flag(argv: list[str], name: str) -> bool:
    """Whether the flag is given at all (a switch such as --online, or a flag with a value)."""
    return any(canonical(flag) == name for flag, _ in split_flags(argv))


def check_known(stage: str, argv: list[str]) -> None:
    """Refuse a flag the stage does not take, before anything runs (a stage outside the schema is not checked)."""
    if stage not in STAGE_FLAGS:
        return
    for name, _ in split_flags(argv):
        if canonical(name) not in STAGE_FLAGS[stage]:
            raise UsageError(f"{stage} does not take {name}; its flags are listed by `python {stage}.py --help`")
