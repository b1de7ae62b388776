"""coordinator: see DESIGN.md. Populated by later issues."""
