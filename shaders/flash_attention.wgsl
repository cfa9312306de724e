// flash_attention: not written yet
