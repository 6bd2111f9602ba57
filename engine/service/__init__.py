"""The OpenAI-compatible service: rank processes and their protocol, the proxy (queue, ranks, text,
metrics, log), the HTTP app, the watchdog, fault control and the supervisor.
"""
