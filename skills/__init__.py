"""Skill format and library lifecycle, the MCP toolbox and its sandbox."""
