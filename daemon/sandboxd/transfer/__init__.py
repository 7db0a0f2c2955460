"""File transfer (FileService): files put into and taken out of a workspace or a leased sandbox."""
