"""rosechat's widgets."""
