//! How lower IOs of stacked devices are linked to their upper IO from what the kernel states:
//! a dm clone points back to the bio it was made from through dm's own per-IO structs, whichever
//! task submits it. Their offsets come from each module's BTF (`/sys/kernel/btf/<module>`),
//! read once the module is loaded; a module without BTF leaves its chain off, and says so.

use std::path::Path;

use tracer_common::StackLayout;

use crate::kernel::btf::Btf;

/// Where the kernel publishes vmlinux's and each loaded module's BTF.
pub const BTF_DIR: &str = "/sys/kernel/btf";

/// One chain from a lower bio back to its upper bio, and what this kernel gave for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// The module whose BTF holds the structs.
    pub module: &'static str,
    /// The chain's name where `tracerd doctor` checks it: the module's, or for a module with
    /// more than one chain, `module/what`.
    pub name: &'static str,
    /// What the chain links.
    pub links: &'static str,
    pub state: ChainState,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChainState {
    /// Resolved: the offsets it reads, in words.
    Linked(String),
    /// The module is not loaded (yet): the chain is resolved when it appears.
    NotLoaded,
    /// The module is loaded without BTF, or its BTF lacks a member: the chain is off.
    Off(String),
}

/// Every chain tracerd knows, resolved against the running kernel. `kprobes`: the submit-path
/// kprobes are attached, which link inline submissions on their own.
pub fn resolve(vmlinux: &Btf, kprobes: bool) -> (StackLayout, Vec<Chain>) {
    let kallsyms = std::cell::OnceCell::new();
    resolve_with(
        vmlinux,
        kprobes,
        |module| {
            let loaded = Path::new("/sys/module").join(module).exists();
            let btf = std::fs::read(Path::new(BTF_DIR).join(module)).ok();
            (loaded, btf)
        },
        |name| {
            kallsyms_address(
                kallsyms.get_or_init(|| std::fs::read_to_string(KALLSYMS).unwrap_or_default()),
                name,
            )
        },
    )
}

const KALLSYMS: &str = "/proc/kallsyms";

/// The address of function `name` in /proc/kallsyms; None where it is absent, or shown as 0
/// (kernel.kptr_restrict hides addresses from a reader without CAP_SYSLOG). `module:name`
/// names a module's function where several modules have one of that name.
pub fn kallsyms_address(text: &str, name: &str) -> Option<u64> {
    let (module, name) = match name.split_once(':') {
        Some((module, name)) => (Some(module), name),
        None => (None, name),
    };
    text.lines()
        .find_map(|line| {
            let mut f = line.split_whitespace();
            let (addr, kind, sym) = (f.next()?, f.next()?, f.next()?);
            let in_module = module
                .is_none_or(|m| f.next().and_then(|o| o.strip_prefix('[')?.strip_suffix(']')) == Some(m));
            (sym == name && matches!(kind, "t" | "T") && in_module)
                .then(|| u64::from_str_radix(addr, 16).ok())
                .flatten()
        })
        .filter(|&a| a != 0)
}

/// [`resolve`], with each module's state (loaded, its BTF) from `module`, and function
/// addresses from `symbol`.
pub fn resolve_with(
    vmlinux: &Btf,
    kprobes: bool,
    module: impl Fn(&str) -> (bool, Option<Vec<u8>>),
    symbol: impl Fn(&str) -> Option<u64>,
) -> (StackLayout, Vec<Chain>) {
    let mut s = StackLayout::default();
    let mut chains = Vec::new();
    let bio_flags = vmlinux.member_offset("bio", &["bi_flags"]).ok();
    let end_io = vmlinux.member_offset("bio", &["bi_end_io"]).ok();
    let cloned = vmlinux.enumerator("BIO_CLONED").and_then(|v| u32::try_from(v).ok()).filter(|&v| v < 16);
    // A module's BTF, or why there is none.
    let load = |name: &str| -> Result<Btf, ChainState> {
        match module(name) {
            (false, _) => Err(ChainState::NotLoaded),
            (true, None) => Err(ChainState::Off(format!(
                "{name} is loaded without BTF ({BTF_DIR}/{name} is missing: the kernel lacks \
                 CONFIG_DEBUG_INFO_BTF_MODULES)"
            ))),
            (true, Some(data)) => Btf::parse_split(&data, vmlinux)
                .map_err(|e| ChainState::Off(format!("{BTF_DIR}/{name}: {e}"))),
        }
    };

    // dm core: a clone is the last member of its dm_target_io, which names its dm_io, which
    // names the original bio.
    let dm = load("dm_mod").and_then(|dm| {
        let off = |strukt: &str, member: &str| {
            dm.member_offset(strukt, &[member]).map_err(|e| ChainState::Off(format!("dm_mod's BTF: {e}")))
        };
        let [clone, tio_magic, tio_io, io_magic, orig] = [
            off("dm_target_io", "clone")?,
            off("dm_target_io", "magic")?,
            off("dm_target_io", "io")?,
            off("dm_io", "magic")?,
            off("dm_io", "orig_bio")?,
        ];
        let (Some(flags), Some(bit)) = (bio_flags, cloned) else {
            return Err(ChainState::Off("vmlinux BTF has no bio.bi_flags or BIO_CLONED".into()));
        };
        (s.dm, s.tio_clone, s.tio_magic, s.tio_io, s.io_magic, s.io_orig_bio) =
            (1, clone, tio_magic, tio_io, io_magic, orig);
        (s.bio_bi_flags, s.bio_cloned_bit) = (flags, bit);
        // dm-io's bios (kcopyd's copies and zeroing, dm-mirror's writes) are dm's own IO.
        let own = match (end_io, symbol("dm_mod:endio")) {
            (Some(off), Some(end)) => {
                (s.bio_bi_end_io, s.dm_io_end) = (off, end);
                "; dm-io's bios end in endio"
            }
            _ => "; dm-io's bios not named (no address for dm_mod's endio)",
        };
        Ok(format!("dm_target_io.clone at {clone}, dm_io.orig_bio at {orig}{own}"))
    });
    chains.push(chain("dm_mod", "dm clones to the bio they were made from, from any task", dm));

    // dm-crypt submits its own clone of dm's clone; its bi_private is the crypt IO.
    let crypt = load("dm_crypt").and_then(|crypt| {
        let base = crypt
            .member_offset("dm_crypt_io", &["base_bio"])
            .map_err(|e| ChainState::Off(format!("dm_crypt's BTF: {e}")))?;
        if s.dm == 0 {
            return Err(ChainState::Off("it needs dm_mod's chain".into()));
        }
        (s.crypt, s.crypt_io_base_bio) = (1, base);
        Ok(format!("dm_crypt_io.base_bio at {base}"))
    });
    chains.push(chain("dm_crypt", "dm-crypt's clones (reads, and writes from its threads)", crypt));

    // Request-based dm (multipath): the clone request dm dispatches ends in end_clone_request,
    // and its end_io_data is the dm_rq_target_io, whose orig is the request dm got.
    let dm_rq = load("dm_mod").and_then(|dm| {
        let orig = dm
            .member_offset("dm_rq_target_io", &["orig"])
            .map_err(|e| ChainState::Off(format!("dm_mod's BTF: {e}")))?;
        let field = |member: &str| {
            vmlinux
                .member_offset("request", &[member])
                .map_err(|e| ChainState::Off(format!("vmlinux BTF: {e}")))
        };
        let (end_io, end_io_data) = (field("end_io")?, field("end_io_data")?);
        let end = symbol("dm_mod:end_clone_request").or_else(|| symbol("end_clone_request")).ok_or_else(|| {
            ChainState::Off(format!(
                "end_clone_request has no address in {KALLSYMS} (absent, or hidden by kernel.kptr_restrict)"
            ))
        })?;
        (s.rq_end_io, s.rq_end_io_data, s.rq_tio_orig, s.dm_rq_end) = (end_io, end_io_data, orig, end);
        Ok(format!("dm_rq_target_io.orig at {orig}, request.end_io_data at {end_io_data}"))
    });
    chains.push(Chain {
        name: "dm_mod/request",
        ..chain(
            "dm_mod",
            "request-based dm's clone requests (multipath) to the request they were made from, from any task",
            dm_rq,
        )
    });

    // md: member bios of raid1 and raid10 name their r1bio/r10bio, whose master_bio is the upper
    // bio or md's accounting clone of it (6.1's md_io_acct, 6.12's md_io_clone).
    let address = |name: &str| {
        symbol(name).ok_or_else(|| {
            ChainState::Off(format!(
                "{name} has no address in {KALLSYMS} (absent, or hidden by kernel.kptr_restrict)"
            ))
        })
    };
    let mut md_acct = false;
    let md = load("md_mod").and_then(|md| {
        let end_io = end_io.ok_or_else(|| ChainState::Off("vmlinux BTF has no bio.bi_end_io".into()))?;
        // Superblock and bitmap writes: labelled md's own IO where the address is known.
        s.md_super_end = symbol("super_written").unwrap_or(0);
        // raid0's split-off front pieces, chained to the rest of the bio.
        s.chain_end = symbol("bio_chain_endio").unwrap_or(0);
        for (strukt, end) in [("md_io_clone", "md_end_clone_io"), ("md_io_acct", "md_end_io_acct")] {
            if let Ok(orig) = md.member_offset(strukt, &["orig_bio"]) {
                (s.md_clone_end, s.md_clone_orig_bio) = (address(end)?, orig);
                s.bio_bi_end_io = end_io;
                md_acct = strukt == "md_io_acct";
                return Ok(format!("{strukt}.orig_bio at {orig}"));
            }
        }
        // No accounting clone on this kernel: a personality's master_bio is the bio itself.
        s.bio_bi_end_io = end_io;
        Ok("no accounting clone".into())
    });
    chains.push(chain("md_mod", "md's accounting clones to the bio md got (raid0's member bios)", md));
    for (module, strukt, read, write) in [
        ("raid1", "r1bio", "raid1_end_read_request", "raid1_end_write_request"),
        ("raid10", "r10bio", "raid10_end_read_request", "raid10_end_write_request"),
    ] {
        let personality = load(module).and_then(|btf| {
            if s.bio_bi_end_io == 0 {
                return Err(ChainState::Off("it needs md_mod's chain".into()));
            }
            let master = btf
                .member_offset(strukt, &["master_bio"])
                .map_err(|e| ChainState::Off(format!("{module}'s BTF: {e}")))?;
            let ends = (address(read)?, address(write)?);
            // Resync IO: labelled md's own where the addresses are known.
            let sync =
                (symbol(&format!("{module}:end_sync_read")), symbol(&format!("{module}:end_sync_write")));
            let sync = (sync.0.unwrap_or(0), sync.1.unwrap_or(0));
            if module == "raid1" {
                (s.raid1_read_end, s.raid1_write_end, s.r1bio_master_bio) = (ends.0, ends.1, master);
                (s.raid1_sync_read_end, s.raid1_sync_write_end) = sync;
            } else {
                (s.raid10_read_end, s.raid10_write_end, s.r10bio_master_bio) = (ends.0, ends.1, master);
                (s.raid10_sync_read_end, s.raid10_sync_write_end) = sync;
            }
            Ok(format!("{strukt}.master_bio at {master}"))
        });
        let links = if module == "raid1" {
            "md raid1's member bios, from any task (raid1d's retries too)"
        } else {
            "md raid10's member bios, from any task (raid10d's retries too)"
        };
        chains.push(chain(module, links, personality));
    }

    // md raid4/5/6: a stripe's member bios are embedded in its stripe_head (dev[i].req,
    // .rreq), which their bi_private names; the device's lists hold the upper bios.
    let raid5 = load("raid456").and_then(|btf| {
        if s.bio_bi_end_io == 0 {
            return Err(ChainState::Off("it needs md_mod's chain".into()));
        }
        let off = |strukt: &str, member: &str| {
            btf.member_offset(strukt, &[member]).map_err(|e| ChainState::Off(format!("raid456's BTF: {e}")))
        };
        let [dev, state, disks, req, rreq, toread, written, sector] = [
            off("stripe_head", "dev")?,
            off("stripe_head", "state")?,
            off("stripe_head", "disks")?,
            off("r5dev", "req")?,
            off("r5dev", "rreq")?,
            off("r5dev", "toread")?,
            off("r5dev", "written")?,
            off("r5dev", "sector")?,
        ];
        let size = btf.struct_size("r5dev").map_err(|e| ChainState::Off(format!("raid456's BTF: {e}")))?;
        let mut own_state = 0u32;
        for bit in ["STRIPE_SYNCING", "STRIPE_EXPANDING", "STRIPE_EXPAND_SOURCE", "STRIPE_REPLACED"] {
            match btf.enumerator(bit).and_then(|v| u32::try_from(v).ok()).filter(|&v| v < 32) {
                Some(v) => own_state |= 1 << v,
                None => return Err(ChainState::Off(format!("raid456's BTF has no {bit}"))),
            }
        }
        let ends = [
            address("raid5_end_read_request")?,
            address("raid5_end_write_request")?,
            address("raid5_align_endio")?,
        ];
        [s.raid5_read_end, s.raid5_write_end, s.raid5_align_end] = ends;
        (s.sh_dev, s.sh_state, s.sh_disks) = (dev, state, disks);
        (s.r5dev_size, s.r5dev_req, s.r5dev_rreq, s.r5dev_toread, s.r5dev_written, s.r5dev_sector) =
            (size, req, rreq, toread, written, sector);
        (s.r5_own_state, s.r5_align_acct) = (own_state, md_acct as u32);
        Ok(format!("stripe_head.dev at {dev}, r5dev size {size}, written at {written}, toread at {toread}"))
    });
    chains.push(chain(
        "raid456",
        "md raid4/5/6's stripe IO to the upper bios whose data it carries (parity, pre-reads and \
         resync as md's own IO), and aligned reads, from any task",
        raid5,
    ));

    // dm-bufio, the block cache of targets' metadata (loaded with the thin pool, dm-cache,
    // dm-verity): its bios are the target's own IO, named by the function they end in.
    let bufio = match module("dm_bufio").0 {
        false => Err(ChainState::NotLoaded),
        true => match (end_io, symbol("dm_bufio:bio_complete")) {
            (Some(off), Some(end)) => {
                (s.bio_bi_end_io, s.dm_bufio_end) = (off, end);
                Ok("its bios end in bio_complete".to_string())
            }
            (None, _) => Err(ChainState::Off("vmlinux BTF has no bio.bi_end_io".into())),
            (_, None) => Err(ChainState::Off(format!(
                "dm_bufio's bio_complete has no address in {KALLSYMS} (absent, or hidden by \
                 kernel.kptr_restrict)"
            ))),
        },
    };
    chains.push(chain(
        "dm_bufio",
        "dm-bufio's bios (a thin pool's or dm-cache's metadata) as the target's own IO",
        bufio,
    ));

    s.links = (kprobes
        || s.dm != 0
        || s.dm_rq_end != 0
        || s.raid1_read_end != 0
        || s.raid10_read_end != 0
        || s.raid5_read_end != 0) as u32;
    (s, chains)
}

fn chain(module: &'static str, links: &'static str, result: Result<String, ChainState>) -> Chain {
    let state = match result {
        Ok(how) => ChainState::Linked(how),
        Err(state) => state,
    };
    Chain { module, name: module, links, state }
}

/// Whether resolving again could give more: a chain waits for its module.
pub fn incomplete(chains: &[Chain]) -> bool {
    chains.iter().any(|c| c.state == ChainState::NotLoaded)
}

/// A chain's state in the words the log and `tracerd doctor` use.
pub fn describe(c: &Chain) -> String {
    match &c.state {
        ChainState::Linked(how) => format!("links {} ({BTF_DIR}/{}: {how})", c.links, c.module),
        ChainState::NotLoaded => format!(
            "{} is not loaded: when it is, tracerd reads {BTF_DIR}/{} and links {}",
            c.module, c.module, c.links
        ),
        ChainState::Off(why) => format!(
            "{why}: {} are not linked (only submissions inside the stacked driver's own call \
             are, through the submit-path kprobes, where the kernel has them)",
            c.links
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::btf::tests::Builder;

    /// vmlinux with `struct bio` and BIO_CLONED: the builder (for modules on top), its BTF, and
    /// the ids of u16, u64 and struct bio.
    fn vmlinux() -> (Builder, Btf, [u32; 3]) {
        let mut base = Builder::new();
        let u16t = base.int("short unsigned int", 2);
        let u64t = base.int("long long unsigned int", 8);
        let bio = base.strukt(
            "bio",
            4,
            128,
            &[("bi_next", u64t, 0), ("bi_flags", u16t, 20), ("bi_end_io", u64t, 56)],
        );
        base.strukt("request", 4, 288, &[("q", u64t, 0), ("end_io", u64t, 240), ("end_io_data", u64t, 248)]);
        base.enumeration("", &[("BIO_NO_PAGE_REF", 0), ("BIO_CLONED", 1)]);
        let btf = Btf::parse(&base.build()).unwrap();
        (base, btf, [u16t, u64t, bio])
    }

    /// vmlinux, and dm_mod's and dm_crypt's split BTF on top of it.
    fn kernel() -> (Btf, Vec<u8>, Vec<u8>) {
        let (base, vmlinux, [u16t, u64t, bio]) = vmlinux();
        let mut dm = Builder::split(&base);
        let io = dm.strukt("dm_io", 4, 200, &[("magic", u16t, 0), ("orig_bio", u64t, 96)]);
        let io_ptr = dm.ptr(io);
        dm.strukt("dm_target_io", 4, 168, &[("magic", u16t, 0), ("io", io_ptr, 8), ("clone", bio, 40)]);
        dm.strukt("dm_rq_target_io", 4, 400, &[("md", u64t, 0), ("ti", u64t, 8), ("orig", u64t, 16)]);
        let mut crypt = Builder::split(&base);
        crypt.strukt("dm_crypt_io", 4, 64, &[("cc", u64t, 0), ("base_bio", u64t, 8)]);
        (vmlinux, dm.build(), crypt.build())
    }

    #[test]
    fn dm_and_crypt_chains_from_their_modules_btf() {
        let (vmlinux, dm, crypt) = kernel();
        let (s, chains) = resolve_with(
            &vmlinux,
            false,
            |m| match m {
                "dm_mod" => (true, Some(dm.clone())),
                "dm_crypt" => (true, Some(crypt.clone())),
                // dm-bufio's own IO needs only its function's address, not its BTF.
                "dm_bufio" => (true, None),
                _ => (false, None),
            },
            |n| match n {
                "dm_mod:end_clone_request" => Some(0xffff_ffff_c000_1000),
                "dm_mod:endio" => Some(0xffff_ffff_c000_2000),
                "dm_bufio:bio_complete" => Some(0xffff_ffff_c000_3000),
                _ => None,
            },
        );
        assert_eq!(
            (s.bio_bi_end_io, s.dm_io_end, s.dm_bufio_end),
            (56, 0xffff_ffff_c000_2000, 0xffff_ffff_c000_3000),
            "dm's own IO, by the function its bios end in"
        );
        assert_eq!((s.links, s.dm, s.crypt), (1, 1, 1));
        assert_eq!(
            (s.rq_end_io, s.rq_end_io_data, s.rq_tio_orig, s.dm_rq_end),
            (240, 248, 16, 0xffff_ffff_c000_1000)
        );
        assert_eq!((s.tio_clone, s.tio_magic, s.tio_io, s.io_magic, s.io_orig_bio), (40, 0, 8, 0, 96));
        assert_eq!((s.bio_bi_flags, s.bio_cloned_bit, s.crypt_io_base_bio), (20, 1, 8));
        let dm_chains = chains.iter().filter(|c| c.module.starts_with("dm_"));
        assert!(
            dm_chains.clone().count() == 4
                && dm_chains.clone().all(|c| matches!(c.state, ChainState::Linked(_)))
        );
        assert!(
            chains.iter().filter(|c| !c.module.starts_with("dm_")).all(|c| c.state == ChainState::NotLoaded)
        );
        assert!(describe(&chains[0]).contains("dm_io.orig_bio at 96"), "{}", describe(&chains[0]));
    }

    #[test]
    fn a_module_not_loaded_waits_and_one_without_btf_says_so() {
        let (vmlinux, dm, _) = kernel();
        let (s, chains) = resolve_with(&vmlinux, false, |_| (false, None), |_| None);
        assert_eq!((s.links, s.dm), (0, 0), "nothing links: queued bios look nothing up");
        assert!(incomplete(&chains));
        assert!(describe(&chains[0]).starts_with("dm_mod is not loaded"));
        let (s, _) = resolve_with(&vmlinux, true, |_| (false, None), |_| None);
        assert_eq!((s.links, s.dm), (1, 0), "the submit kprobes link on their own");

        let (s, chains) = resolve_with(
            &vmlinux,
            false,
            |m| match m {
                "dm_mod" => (true, Some(dm.clone())),
                _ => (true, None),
            },
            |_| None,
        );
        assert_eq!((s.dm, s.crypt), (1, 0));
        let crypt = describe(&chains[1]);
        assert!(crypt.contains("CONFIG_DEBUG_INFO_BTF_MODULES") && crypt.contains("not linked"), "{crypt}");
        let rq = describe(&chains[2]);
        assert!(rq.contains("end_clone_request has no address") && rq.contains("multipath"), "{rq}");
        assert_eq!((s.dm_rq_end, s.links), (0, 1), "dm's bio chain still links");
        assert_eq!((s.dm_io_end, s.dm_bufio_end), (0, 0), "no address, no own IO named");
        let bufio = describe(chains.iter().find(|c| c.name == "dm_bufio").unwrap());
        assert!(bufio.contains("bio_complete has no address"), "{bufio}");
    }

    #[test]
    fn md_chains_from_raid1_raid10_and_md_mod_btf_and_kallsyms() {
        let mut base = Builder::new();
        let u64t = base.int("long long unsigned int", 8);
        base.strukt("bio", 4, 128, &[("bi_end_io", u64t, 56), ("bi_private", u64t, 64)]);
        let vmlinux = Btf::parse(&base.build()).unwrap();
        let mut md = Builder::split(&base);
        md.strukt("md_io_clone", 4, 200, &[("mddev", u64t, 0), ("orig_bio", u64t, 8)]);
        let mut raid1 = Builder::split(&base);
        raid1.strukt("r1bio", 4, 64, &[("mddev", u64t, 32), ("master_bio", u64t, 40)]);
        let mut raid10 = Builder::split(&base);
        raid10.strukt("r10bio", 4, 64, &[("master_bio", u64t, 48)]);
        let (md, raid1, raid10) = (md.build(), raid1.build(), raid10.build());
        let modules = |m: &str| match m {
            "md_mod" => (true, Some(md.clone())),
            "raid1" => (true, Some(raid1.clone())),
            "raid10" => (true, Some(raid10.clone())),
            _ => (false, None),
        };
        let kallsyms = "ffffffff81001000 t bio_chain_endio\n\
                        ffffffffc0001000 t md_end_clone_io\t[md_mod]\n\
                        ffffffffc0002000 t raid1_end_read_request\t[raid1]\n\
                        ffffffffc0002100 t raid1_end_write_request\t[raid1]\n\
                        ffffffffc0003000 t raid10_end_read_request\t[raid10]\n\
                        ffffffffc0003100 t raid10_end_write_request\t[raid10]\n";
        let (s, chains) = resolve_with(&vmlinux, false, modules, |n| kallsyms_address(kallsyms, n));
        assert_eq!((s.links, s.bio_bi_end_io, s.md_clone_orig_bio), (1, 56, 8));
        assert_eq!((s.md_clone_end, s.chain_end), (0xffff_ffff_c000_1000, 0xffff_ffff_8100_1000));
        assert_eq!(
            (s.raid1_read_end, s.raid1_write_end, s.r1bio_master_bio),
            (0xffff_ffff_c000_2000, 0xffff_ffff_c000_2100, 40)
        );
        assert_eq!(
            (s.raid10_read_end, s.raid10_write_end, s.r10bio_master_bio),
            (0xffff_ffff_c000_3000, 0xffff_ffff_c000_3100, 48)
        );
        let raid1 = chains.iter().find(|c| c.module == "raid1").unwrap();
        assert!(describe(raid1).contains("r1bio.master_bio at 40"), "{}", describe(raid1));

        // Addresses hidden (kernel.kptr_restrict shows zeros): the chains are off, and say why.
        let hidden: String = kallsyms.lines().map(|l| format!("0000000000000000{}\n", &l[16..])).collect();
        let (s, chains) = resolve_with(&vmlinux, false, modules, |n| kallsyms_address(&hidden, n));
        assert_eq!((s.links, s.raid1_read_end, s.md_clone_end), (0, 0, 0));
        let md = describe(chains.iter().find(|c| c.module == "md_mod").unwrap());
        assert!(md.contains("kptr_restrict"), "{md}");
    }

    #[test]
    fn raid456_chain_from_its_btf_with_6_1s_accounting_struct_and_sync_ends_by_module() {
        let mut base = Builder::new();
        let u64t = base.int("long long unsigned int", 8);
        let i32t = base.int("int", 4);
        let bio = base.strukt("bio", 4, 128, &[("bi_end_io", u64t, 56), ("bi_private", u64t, 64)]);
        let vmlinux = Btf::parse(&base.build()).unwrap();
        let mut md = Builder::split(&base);
        md.strukt("md_io_acct", 4, 160, &[("orig_bio", u64t, 0), ("start_time", u64t, 8)]);
        let mut raid1 = Builder::split(&base);
        raid1.strukt("r1bio", 4, 64, &[("master_bio", u64t, 40)]);
        let mut raid5 = Builder::split(&base);
        raid5.strukt(
            "r5dev",
            4,
            368,
            &[
                ("req", bio, 0),
                ("rreq", bio, 128),
                ("toread", u64t, 312),
                ("written", u64t, 336),
                ("sector", u64t, 344),
            ],
        );
        raid5.strukt("stripe_head", 4, 224, &[("state", u64t, 72), ("disks", i32t, 88), ("dev", u64t, 224)]);
        raid5.enumeration(
            "",
            &[
                ("STRIPE_SYNCING", 3),
                ("STRIPE_REPLACED", 6),
                ("STRIPE_EXPANDING", 10),
                ("STRIPE_EXPAND_SOURCE", 11),
            ],
        );
        let (md, raid1, raid5) = (md.build(), raid1.build(), raid5.build());
        let modules = |m: &str| match m {
            "md_mod" => (true, Some(md.clone())),
            "raid1" => (true, Some(raid1.clone())),
            "raid456" => (true, Some(raid5.clone())),
            _ => (false, None),
        };
        let kallsyms = "ffffffffc0001000 t md_end_io_acct\t[md_mod]\n\
                        ffffffffc0001100 t super_written\t[md_mod]\n\
                        ffffffffc0002000 t raid1_end_read_request\t[raid1]\n\
                        ffffffffc0002100 t raid1_end_write_request\t[raid1]\n\
                        ffffffffc0004000 t end_sync_read\t[raid10]\n\
                        ffffffffc0002200 t end_sync_read\t[raid1]\n\
                        ffffffffc0002300 t end_sync_write\t[raid1]\n\
                        ffffffffc0005000 t raid5_end_read_request\t[raid456]\n\
                        ffffffffc0005100 t raid5_end_write_request\t[raid456]\n\
                        ffffffffc0005200 t raid5_align_endio\t[raid456]\n";
        let (s, chains) = resolve_with(&vmlinux, false, modules, |n| kallsyms_address(kallsyms, n));
        assert_eq!(s.links, 1);
        assert_eq!(
            [s.raid5_read_end, s.raid5_write_end, s.raid5_align_end, s.md_super_end],
            [0xffff_ffff_c000_5000, 0xffff_ffff_c000_5100, 0xffff_ffff_c000_5200, 0xffff_ffff_c000_1100]
        );
        assert_eq!(
            (s.raid1_sync_read_end, s.raid1_sync_write_end),
            (0xffff_ffff_c000_2200, 0xffff_ffff_c000_2300)
        );
        assert_eq!((s.sh_dev, s.sh_state, s.sh_disks), (224, 72, 88));
        assert_eq!(
            (s.r5dev_size, s.r5dev_req, s.r5dev_rreq, s.r5dev_toread, s.r5dev_written, s.r5dev_sector),
            (368, 0, 128, 312, 336, 344)
        );
        assert_eq!(s.r5_own_state, 1 << 3 | 1 << 6 | 1 << 10 | 1 << 11);
        assert_eq!(s.r5_align_acct, 1, "6.1: an aligned read's bi_private is its md_io_acct");
        let raid5 = describe(chains.iter().find(|c| c.module == "raid456").unwrap());
        assert!(raid5.contains("r5dev size 368"), "{raid5}");

        // Without its module's enum, the chain is off and names what is missing.
        let mut bare = Builder::split(&base);
        bare.strukt("r5dev", 4, 368, &[("req", bio, 0)]);
        let bare = bare.build();
        let (s, chains) = resolve_with(
            &vmlinux,
            false,
            |m| if m == "raid456" { (true, Some(bare.clone())) } else { modules(m) },
            |n| kallsyms_address(kallsyms, n),
        );
        assert_eq!(s.raid5_read_end, 0);
        let raid5 = describe(chains.iter().find(|c| c.module == "raid456").unwrap());
        assert!(raid5.contains("stripe_head"), "{raid5}");
    }

    #[test]
    fn a_module_btf_without_the_members_turns_its_chain_off() {
        let (base, vmlinux, [u16t, ..]) = vmlinux();
        let mut dm = Builder::split(&base);
        dm.strukt("dm_target_io", 4, 8, &[("magic", u16t, 0)]);
        let dm = dm.build();
        let (s, chains) =
            resolve_with(&vmlinux, false, |m| (true, (m == "dm_mod").then(|| dm.clone())), |_| None);
        assert_eq!((s.dm, s.links), (0, 0));
        let why = describe(&chains[0]);
        assert!(why.contains("dm_target_io") && why.contains("clone"), "{why}");
    }
}
