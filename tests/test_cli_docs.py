"""docs/cli.md and the command line agree: every flag a parser has is documented, and every documented flag exists.

The parsers are built in-process (`grouprl.cli.<command>.build_parser`, `grouprl.cli.train_arguments.build_parser`),
no subprocess. docs/cli.md marks each command's flag list with `<!-- flags:NAME -->` ... `<!-- /flags -->`; every
`` `--flag` `` (and, for positionals, `` `NAME` ``) inside a region is a documented flag of that command.
"""

import argparse
import os
import re

import pytest

from grouprl.cli import COMMANDS, main

CLI_DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")


def doc_text() -> str:
    with open(CLI_DOC, encoding="utf-8") as handle:
        return handle.read()


def documented(command: str) -> tuple[set[str], set[str]]:
    """(flags, positionals) listed in the command's region of docs/cli.md."""
    regions = re.findall(rf"<!-- flags:{command} -->(.*?)<!-- /flags -->", doc_text(), flags=re.S)
    assert len(regions) == 1, f"docs/cli.md needs exactly one <!-- flags:{command} --> region, found {len(regions)}"
    flags = set(re.findall(r"`(--[a-z0-9][a-z0-9_]*)`", regions[0]))
    positionals = set(re.findall(r"^\| `([A-Z][A-Z_]*)` \|", regions[0], flags=re.M))
    return flags, positionals


def parser_flags(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """(the first option string of every optional except --help, the upper-cased names of the positionals)."""
    flags, positionals = set(), set()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if action.option_strings:
            flags.add(action.option_strings[0])
        else:
            positionals.add(action.dest.upper())
    return flags, positionals


def build(command: str) -> argparse.ArgumentParser:
    if command == "train":
        from grouprl.cli.train_arguments import build_parser
    elif command == "serve":
        from grouprl.cli.serve import build_parser
    elif command == "demo":
        from grouprl.cli.demo import build_parser
    else:
        from grouprl.cli.report import build_parser
    return build_parser()


def assert_same(command: str, in_parser: set[str], in_doc: set[str]) -> None:
    undocumented = sorted(in_parser - in_doc)
    unknown = sorted(in_doc - in_parser)
    assert not undocumented, f"grouprl {command} has flags docs/cli.md does not list: {undocumented}"
    assert not unknown, f"docs/cli.md lists flags grouprl {command} does not have: {unknown}"


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_flag_is_documented_and_every_documented_flag_exists(command):
    parser = build(command)
    flags, positionals = parser_flags(parser)
    doc_flags, doc_positionals = documented(command)
    assert_same(command, flags, doc_flags)
    assert_same(command, positionals, doc_positionals)
    if command == "train":
        assert len(flags) > 200 and "--num_generations" in flags  # the region was read, not an empty match


def test_train_flags_take_snake_or_kebab_case_only():
    """The page says each train flag also accepts its --kebab-case spelling, and nothing else."""
    for action in build("train")._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        first = action.option_strings[0]
        assert set(action.option_strings) <= {first, first.replace("_", "-")}, action.option_strings
        assert re.fullmatch(r"--[a-z0-9_]+", first), first


def test_the_flags_read_before_the_parser_are_documented_and_work(tmp_path):
    """--config and --accelerate_config are read by pre-parsers (parse_train_args, launch_command)."""
    from grouprl.cli.train_arguments import parse_train_args
    from grouprl.launch import launch_command

    text = doc_text()
    assert "`--config FILE.yaml`" in text and "`--accelerate_config NAME`" in text
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("num_generations: 4\nenv:\n  GROUPRL_CLI_DOCS_TEST: 'yes'\n")
    _, config, _ = parse_train_args(["--config", str(yaml_file), "--output_dir", str(tmp_path), "--max_steps", "3"])
    assert config.num_generations == 4 and config.max_steps == 3
    assert os.environ.pop("GROUPRL_CLI_DOCS_TEST") == "yes"  # the env: mapping the page describes
    command = launch_command(["--accelerate_config", "multi_gpu", "--num_processes", "2", "--max_steps", "1"])
    launcher, train = command[: command.index("grouprl.cli")], command[command.index("grouprl.cli") :]
    assert "--num_processes" in launcher and "--max_steps" in train  # unknown flags go to accelerate launch


def test_top_level_help_lists_the_documented_subcommands(capsys):
    assert main(["--help"]) == 0
    printed = capsys.readouterr().out
    text = doc_text()
    headings = set(re.findall(r"^## grouprl (\w+)$", text, flags=re.M))
    assert headings == set(COMMANDS), f"docs/cli.md sections {sorted(headings)} vs commands {sorted(COMMANDS)}"
    for name in COMMANDS:
        assert re.search(rf"^  {name}\s", printed, flags=re.M), f"grouprl --help does not list {name}"
        assert re.search(rf"^  {name}\s", text, flags=re.M), f"docs/cli.md's grouprl --help block does not list {name}"
