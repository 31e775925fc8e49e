//! The guest's `/init`: the script template (`guest/init.sh`: mounts, modules, the shared
//! devices, teardown) filled in with the hang bound and the scenarios, and [`scenario`], which
//! wraps a scenario's body so that it runs when chosen and skips, loudly, without its modules.

use super::GUEST_HANG;

/// The /init template; `@NAME@` marks what [`guest_script`] fills in.
const INIT: &str = include_str!("guest/init.sh");

/// Shell functions that decide which scenarios run: `scenarios` and `absent` (modules this
/// kernel's package lacks) are comma lists from the kernel command line.
const SCENARIO_SELECTION: &str = r#"vm_listed() { case ",$2," in *",$1,"*) return 0;; esac; return 1; }
vm_wants() { [ "$scenarios" = all ] || vm_listed "$1" "$scenarios"; }
vm_have() { for m in "$@"; do vm_listed "$m" "$absent" && return 1; done; return 0; }
vm_missing() { for m in "$@"; do vm_listed "$m" "$absent" && printf '%s ' "$m"; done; }"#;

/// A scenario body that runs when the kernel command line's `scenarios=` lists NAME (or is
/// `all`, the default), and the kernel has every module of `needs`; otherwise it prints
/// `VM-SKIPPED NAME: ...` with the missing modules. Its output should put results between
/// `VM-RESULT-BEGIN NAME` and `VM-RESULT-END NAME`. A scenario that ran ends with
/// `VM-ELAPSED NAME START END` (the guest's uptime in seconds), which xtask sums up per run.
pub fn scenario(name: &str, needs: &[&str], body: &str) -> String {
    let needs = needs.join(" ");
    format!(
        "if vm_wants {name}; then\n\
         if vm_have {needs}; then\n\
         vm_t0=$(cut -d' ' -f1 /proc/uptime)\n\
         echo 'VM-SCENARIO {name}'\n{body}\n\
         echo \"VM-ELAPSED {name} $vm_t0 $(cut -d' ' -f1 /proc/uptime)\"\n\
         else echo \"VM-SKIPPED {name}: kernel $(uname -r) has no module $(vm_missing {needs})\"; fi\nfi\n"
    )
}

/// The /init script (`guest/init.sh`): mounts, loads those of
/// [`GUEST_MODULES`](super::modules::GUEST_MODULES) the kernel has (the command line's `absent=`
/// names the others, `builtin=` those built in), creates md0, lin0 (dm-0), mp0 (dm-1) and nullb0
/// where their modules allow, runs `scenarios` (shell text, see [`scenario`]), tears the devices
/// down and powers off. A failed set-up step prints `VM-SETUP-FAILED <step>` and powers off at
/// once.
pub fn guest_script(scenarios: &str) -> String {
    let hang_s = GUEST_HANG.as_secs();
    // The scenarios go in last, so that nothing in them is taken for a placeholder.
    INIT.replace("@HANG_S@", &hang_s.to_string())
        .replace("@HANG_TENTHS@", &(hang_s * 10).to_string())
        .replace("@SCENARIO_SELECTION@", SCENARIO_SELECTION)
        .replace("@SCENARIOS@", scenarios)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;

    /// The selection as the guest's shell runs it (busybox sh there; sh here).
    #[test]
    fn scenarios_run_when_chosen_and_skip_loudly_without_their_modules() {
        let guest = |scenarios: &str, absent: &str| {
            let script = format!(
                "{SCENARIO_SELECTION}\nscenarios={scenarios}\nabsent={absent}\n{}{}",
                scenario("md", &["brd", "raid1"], "echo md ran"),
                scenario("cg", &[], "echo cg ran")
            );
            let out = Command::new("sh").arg("-c").arg(&script).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let out = String::from_utf8(out.stdout).unwrap();
            // Each scenario that ran says how long it took; the rest is compared whole.
            let elapsed: Vec<&str> = out.lines().filter(|l| l.starts_with("VM-ELAPSED ")).collect();
            for l in &elapsed {
                let f: Vec<&str> = l.split(' ').collect();
                assert_eq!(f.len(), 4, "{l}");
                assert!(f[2].parse::<f64>().unwrap() <= f[3].parse::<f64>().unwrap(), "{l}");
            }
            let ran = out.lines().filter(|l| l.starts_with("VM-SCENARIO ")).count();
            assert_eq!(elapsed.len(), ran, "{out}");
            out.lines()
                .filter(|l| !l.starts_with("VM-ELAPSED "))
                .map(|l| format!("{l}\n"))
                .collect::<String>()
        };
        assert_eq!(guest("all", ""), "VM-SCENARIO md\nmd ran\nVM-SCENARIO cg\ncg ran\n");
        assert_eq!(guest("cg,doctor", ""), "VM-SCENARIO cg\ncg ran\n");
        let skipped = guest("all", "loop,raid1");
        assert!(
            skipped.starts_with("VM-SKIPPED md: kernel ") && skipped.contains("has no module raid1 \n"),
            "{skipped}"
        );
        assert!(skipped.ends_with("VM-SCENARIO cg\ncg ran\n"), "{skipped}");
    }
}
