"""DynamicVRAM start-up, shared by main.py and the headless worker processes of comfy.parallel."""

import logging

import comfy_aimdo.control

from comfy.cli_args import args, enables_dynamic_vram


def init_allocator():
    """Before torch uses the GPU."""
    if enables_dynamic_vram():
        simple_vram_headroom = None if args.reserve_vram is None else int(args.reserve_vram * 1024 ** 3)
        comfy_aimdo.control.init(simple_vram_headroom=simple_vram_headroom, nvml_pressure=not args.disable_nvml_pressure)


def enable(console_log_level):
    """After init_allocator(): switch to ModelPatcherDynamic where DynamicVRAM works."""
    # model_management reads the device at import, which must follow init_allocator()
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    mm = comfy.model_management
    supported = mm.is_nvidia() or (mm.is_amd() and mm.rocm_version >= (7, 14))
    if not (args.enable_dynamic_vram or (enables_dynamic_vram() and supported)):
        return
    if not args.enable_dynamic_vram and mm.torch_version_numeric < (2, 8):
        logging.warning("Unsupported Pytorch detected. DynamicVRAM support requires Pytorch version 2.8 or later. Falling back to legacy ModelPatcher. VRAM estimates may be unreliable especially on Windows")
        return
    if not comfy_aimdo.control.init_devices((d.index, int(args.vram_headroom * 1024 ** 3)) for d in mm.get_all_torch_devices()):
        logging.warning("No working comfy-aimdo install detected. DynamicVRAM support disabled. Falling back to legacy ModelPatcher. VRAM estimates may be unreliable especially on Windows")
        return
    levels = {"DEBUG": comfy_aimdo.control.set_log_debug, "CRITICAL": comfy_aimdo.control.set_log_critical,
              "ERROR": comfy_aimdo.control.set_log_error, "WARNING": comfy_aimdo.control.set_log_warning}
    levels.get(console_log_level, comfy_aimdo.control.set_log_info)()
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    logging.info("DynamicVRAM support detected and enabled")
