//! `oomprobe devices`: every adapter wgpu sees on every backend (and CUDA devices when built in),
//! as a table or as the JSON array of the contract.
//!
//! `index` is what `--device` takes: the position among all wgpu adapters, or the CUDA ordinal
//! for `backend: "cuda"` rows. Memory is what the API tells (null where it does not); lavapipe
//! reports a 2 GiB heap it does not enforce.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ContentArrangement, Table};

use crate::backend::nvidia;
use crate::backend::open::{self, NO_ADAPTER_HINT};
use crate::backend::DeviceInfo;
use crate::cli::DevicesArgs;
use crate::error::{CliError, CliResult};
use crate::units::fmt_bytes;

pub fn run(args: &DevicesArgs) -> CliResult<()> {
    let mut devices = open::list_devices();
    let icd_advice = nvidia::cpu_only_advice(&devices, nvidia::detect());
    let cuda = open::list_cuda_devices();
    let cuda_note = match cuda {
        Ok(list) => {
            devices.extend(list);
            None
        }
        Err(reason) => Some(reason),
    };
    if devices.is_empty() {
        return Err(CliError::run(match icd_advice {
            Some(a) => format!("{NO_ADAPTER_HINT}; {a}"),
            None => NO_ADAPTER_HINT.to_string(),
        }));
    }
    if args.json {
        let text = serde_json::to_string_pretty(&devices)
            .map_err(|e| CliError::run(format!("writing JSON: {e}")))?;
        println!("{text}");
        if let Some(a) = &icd_advice {
            eprintln!("oomprobe: note: {a}");
        }
    } else {
        println!("{}", table(&devices));
        if cfg!(feature = "cuda") {
            if let Some(reason) = cuda_note {
                println!("CUDA: unavailable ({reason})");
            }
        }
        if devices
            .iter()
            .any(|d| d.device_type == crate::backend::DeviceType::Cpu)
        {
            println!(
                "Note: CPU adapters (e.g. lavapipe) report a heap size they do not enforce; \
                 their real limit is host memory."
            );
        }
        if let Some(a) = &icd_advice {
            println!("Note: {a}");
        }
    }
    Ok(())
}

fn opt_bytes(v: Option<u64>) -> String {
    v.map_or_else(|| "-".to_string(), fmt_bytes)
}

/// The human table of devices.
pub fn table(devices: &[DeviceInfo]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Dynamic)
        .set_header(vec![
            "#",
            "name",
            "backend",
            "type",
            "driver",
            "memory",
            "free",
            "overhead",
            "max buffer",
            "max binding",
        ]);
    for d in devices {
        let ty = serde_json::to_value(d.device_type)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        t.add_row(vec![
            Cell::new(d.index).set_alignment(CellAlignment::Right),
            Cell::new(&d.name),
            Cell::new(d.backend.as_str()),
            Cell::new(ty),
            Cell::new(&d.driver),
            Cell::new(opt_bytes(d.memory_total_bytes)).set_alignment(CellAlignment::Right),
            Cell::new(opt_bytes(d.memory_free_bytes)).set_alignment(CellAlignment::Right),
            Cell::new(opt_bytes(d.overhead_bytes)).set_alignment(CellAlignment::Right),
            Cell::new(fmt_bytes(d.max_buffer_size)).set_alignment(CellAlignment::Right),
            Cell::new(fmt_bytes(d.max_storage_binding_size)).set_alignment(CellAlignment::Right),
        ]);
    }
    t
}
