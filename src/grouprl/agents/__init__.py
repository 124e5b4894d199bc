"""Agent training: tool calling, multi-turn rollouts, environments and custom rollout functions.

    GRPOTrainer(..., tools=[fn, ...])                       # tools.py: schemas, execution
    GRPOTrainer(..., environment_factory=Env or {name: Env}) # environments.py
    GRPOTrainer(..., rollout_func=f)                        # custom.py

Multi-turn sequences are built token-exactly (multiturn.py, chat.py): sampled tokens plus
chat-template suffix tokens, with a tool mask that keeps tool output out of the loss.
"""

from grouprl.agents.agent import Agent, AgentSpec, tool_call_stats
from grouprl.agents.chat import check_tool_template, tool_suffix_ids
from grouprl.agents.custom import encode_prompts
from grouprl.agents.parsing import parse_hermes, parse_turn
from grouprl.agents.tools import Tool, ToolResult, execute_tool_calls, make_tools

__all__ = [
    "Agent",
    "AgentSpec",
    "Tool",
    "ToolResult",
    "check_tool_template",
    "encode_prompts",
    "execute_tool_calls",
    "make_tools",
    "parse_hermes",
    "parse_turn",
    "tool_call_stats",
    "tool_suffix_ids",
]
