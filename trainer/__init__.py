"""The bundled DFlash drafter trainer (runs on the GPU host; never imports dflash_ops)."""
