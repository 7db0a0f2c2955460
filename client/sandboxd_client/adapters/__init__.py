"""Tools for agent frameworks over a Sandbox the caller opened (docs/PYTHON.md, "Agent
frameworks"). A module per framework, each a thin layer over toolkit.py:

- openai_agents.py: FunctionTools for the OpenAI Agents SDK (the `openai-agents` extra)
- langchain.py: StructuredTools for LangChain (the `langchain` extra)
- smolagents.py: smolagents Tools (the `smolagents` extra)
- toolkit.py: the tools without a framework: run_command, read_file, write_file
- text.py: what they say to the model (output capped, head and tail)
- extras.py: the ImportError that names the extra to install

Importing this package imports no framework; a framework is imported by its own module
only, which raises ImportError naming the extra when the framework is not installed."""

from .toolkit import SandboxToolError, SandboxTools, ToolLimits

__all__ = ["SandboxToolError", "SandboxTools", "ToolLimits"]
