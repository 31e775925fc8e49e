//! Reading ELF64 program headers: whether a binary needs a loader (static builds, busybox) and
//! whether a kernel has the PVH entry note qemu boots it through.

use anyhow::{Context, Result, ensure};

struct ProgramHeader {
    kind: u32,
    offset: usize,
    size: usize,
}

const PT_INTERP: u32 = 3;
const PT_NOTE: u32 = 4;
/// XEN_ELFNOTE_PHYS32_ENTRY: the 32-bit entry point qemu uses to boot an ELF kernel (PVH).
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// Program headers of a little-endian ELF64 file.
fn program_headers(elf: &[u8]) -> Result<Vec<ProgramHeader>> {
    ensure!(elf.len() >= 64 && elf[..4] == *b"\x7fELF", "not an ELF file");
    ensure!(elf[4] == 2 && elf[5] == 1, "not a little-endian 64-bit ELF file");
    let u16_at = |o: usize| u16::from_le_bytes([elf[o], elf[o + 1]]) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().unwrap()) as usize;
    let (phoff, phentsize, phnum) = (u64_at(32), u16_at(54), u16_at(56));
    ensure!(phentsize >= 56 && phoff + phentsize * phnum <= elf.len(), "truncated ELF program headers");
    Ok((0..phnum)
        .map(|i| {
            let h = phoff + i * phentsize;
            ProgramHeader { kind: u32_at(h), offset: u64_at(h + 8), size: u64_at(h + 32) }
        })
        .collect())
}

pub fn has_interp(elf: &[u8]) -> Result<bool> {
    Ok(program_headers(elf)?.iter().any(|h| h.kind == PT_INTERP))
}

pub fn has_pvh_note(elf: &[u8]) -> Result<bool> {
    for h in program_headers(elf)?.iter().filter(|h| h.kind == PT_NOTE) {
        let notes = elf.get(h.offset..h.offset + h.size).context("truncated ELF note")?;
        let mut at = 0;
        // Each note: namesz, descsz, type, name (4-aligned), desc (4-aligned).
        while at + 12 <= notes.len() {
            let word = |o: usize| u32::from_le_bytes(notes[o..o + 4].try_into().unwrap()) as usize;
            let (namesz, descsz, kind) = (word(at), word(at + 4), word(at + 8) as u32);
            let name = notes.get(at + 12..at + 12 + namesz).unwrap_or_default();
            if name == b"Xen\0" && kind == XEN_ELFNOTE_PHYS32_ENTRY {
                return Ok(true);
            }
            at += 12 + namesz.div_ceil(4) * 4 + descsz.div_ceil(4) * 4;
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    /// A minimal ELF64 with one PT_NOTE segment holding `notes`.
    fn elf_with_notes(notes: &[(&[u8], u32)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (name, kind) in notes {
            for w in [name.len() as u32, 4, *kind] {
                body.extend_from_slice(&w.to_le_bytes());
            }
            body.extend_from_slice(name);
            body.resize(body.len().div_ceil(4) * 4, 0);
            body.extend_from_slice(&[1, 2, 3, 4]);
        }
        let mut elf = vec![0u8; 64 + 56];
        elf[..6].copy_from_slice(b"\x7fELF\x02\x01");
        elf[32..40].copy_from_slice(&64u64.to_le_bytes()); // e_phoff
        elf[54..56].copy_from_slice(&56u16.to_le_bytes()); // e_phentsize
        elf[56..58].copy_from_slice(&1u16.to_le_bytes()); // e_phnum
        elf[64..68].copy_from_slice(&PT_NOTE.to_le_bytes());
        elf[72..80].copy_from_slice(&120u64.to_le_bytes()); // p_offset
        elf[96..104].copy_from_slice(&(body.len() as u64).to_le_bytes()); // p_filesz
        elf.extend_from_slice(&body);
        elf
    }

    #[test]
    fn pvh_note() {
        let pvh = elf_with_notes(&[(b"GNU\0", 3), (b"Xen\0", XEN_ELFNOTE_PHYS32_ENTRY)]);
        assert!(has_pvh_note(&pvh).unwrap());
        assert!(!has_interp(&pvh).unwrap());
        assert!(!has_pvh_note(&elf_with_notes(&[(b"Xen\0", 6), (b"GNU\0", 18)])).unwrap());
    }

    #[test]
    fn elf_checks_on_host_files() {
        // The xtask binary itself: dynamically linked on glibc hosts.
        let me = fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(program_headers(&me).is_ok());
        assert!(!has_pvh_note(&me).unwrap());
        assert!(program_headers(b"not an elf file, but long enough to be read as a header........").is_err());
    }
}
