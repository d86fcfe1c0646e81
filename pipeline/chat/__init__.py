"""What a chat model's output means: its thinking apart from its answer, and its tool calls as
structured calls, parsed from the text as it streams (reasoning.py, tool_calls.py), for the
front-ends (serve, batch) to put in their own formats (output.py joins the two). The parsers yield
the events of events.py and find their markers with scan.py; templates/ holds published chat
templates they are tested against."""
