"""What a sandbox engine is told and how it is driven: the protocol, the attachments and spec, the output spool."""
