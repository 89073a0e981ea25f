"""Workflows: plain async Python for one episode, calling agents by name."""
from masrl.workflows.base import WORKFLOWS, Team, WorkflowSpec, get_workflow, register_workflow, render

__all__ = ["WORKFLOWS", "Team", "WorkflowSpec", "get_workflow", "register_workflow", "render"]
