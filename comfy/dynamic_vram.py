"""DynamicVRAM start-up, shared by main.py and headless ComfyUI processes (comfy.parallel workers)."""

import logging

import comfy_aimdo.control

from comfy.cli_args import args, enables_dynamic_vram


def init_allocator():
    """Before torch uses the GPU."""
    if enables_dynamic_vram():
        simple_vram_headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
        try:
            comfy_aimdo.control.init(simple_vram_headroom=simple_vram_headroom, nvml_pressure=not args.disable_nvml_pressure)
        except TypeError:
            # comfy-aimdo 0.4.10 protocol.
            try:
                comfy_aimdo.control.init(simple_vram_headroom=simple_vram_headroom)
            except TypeError:
                # comfy-aimdo 0.4.9 protocol.
                comfy_aimdo.control.init()


def dynamic_vram_supported():
    import comfy.model_management
    if comfy.model_management.is_nvidia():
        return True
    if comfy.model_management.is_amd():
        if comfy.model_management.rocm_version >= (7, 14):
            return True
    return False


def enable(console_log_level):
    """After comfy.model_management is imported: switch to ModelPatcherDynamic when DynamicVRAM works here."""
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    if args.enable_dynamic_vram or (enables_dynamic_vram() and dynamic_vram_supported()):
        if (not args.enable_dynamic_vram) and (comfy.model_management.torch_version_numeric < (2, 8)):
            logging.warning("Unsupported Pytorch detected. DynamicVRAM support requires Pytorch version 2.8 or later. Falling back to legacy ModelPatcher. VRAM estimates may be unreliable especially on Windows")
        else:
            try:
                aimdo_initialized = comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3)) for d in comfy.model_management.get_all_torch_devices())
            except TypeError:
                # comfy-aimdo 0.4.9 protocol.
                aimdo_initialized = comfy_aimdo.control.init_devices(d.index for d in comfy.model_management.get_all_torch_devices())

            if aimdo_initialized:
                if console_log_level == 'DEBUG':
                    comfy_aimdo.control.set_log_debug()
                elif console_log_level == 'DETAIL':
                    try:
                        comfy_aimdo.control.set_log_detail()
                    except AttributeError:
                        comfy_aimdo.control.set_log_info()
                elif console_log_level == 'CRITICAL':
                    comfy_aimdo.control.set_log_critical()
                elif console_log_level == 'ERROR':
                    comfy_aimdo.control.set_log_error()
                elif console_log_level == 'WARNING':
                    comfy_aimdo.control.set_log_warning()
                else: #INFO
                    comfy_aimdo.control.set_log_info()

                comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
                comfy.memory_management.aimdo_enabled = True
                logging.info("DynamicVRAM support detected and enabled")
            else:
                logging.warning("No working comfy-aimdo install detected. DynamicVRAM support disabled. Falling back to legacy ModelPatcher. VRAM estimates may be unreliable especially on Windows")
