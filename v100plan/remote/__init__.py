"""Remote work over SSH (Fabric): host specs, safe connections, the bundle, probe and deploy.

The only package that imports fabric or paramiko, and only inside functions, so the CLI
loads without them (they come with the ``deploy`` extra).
"""
