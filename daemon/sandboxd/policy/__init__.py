"""The call and policy models, resolution, egress rules, image allowlist, host preflight and approvals (pure where they can be)."""
