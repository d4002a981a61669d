"""The chat: conversations in app/store.py, streaming replies, and the Qt views."""
