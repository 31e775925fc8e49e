//! How a cgroup is named and labelled: a cgroup id's name as the daemon resolves it, and the
//! label forms of config `[cgroups] label` (path, systemd unit, Kubernetes pod).

use std::sync::Arc;

/// A cgroup as the daemon names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Named {
    /// Its path from the hierarchy's root ("/" for the root).
    Path(Arc<str>),
    /// The id is no cgroup of the hierarchy (any more): it went before it could be named.
    Gone,
    /// No hierarchy to look in (cgroups not mounted), or the id is unknown (0).
    Unknown,
}

/// How the `cgroup` label names a cgroup (config `[cgroups] label`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LabelForm {
    /// No cgroup label (the default: one series per device and op).
    #[default]
    None,
    /// The cgroup's path ("/system.slice/nginx.service").
    Path,
    /// The systemd unit ("nginx.service"); the path where there is none.
    Unit,
    /// The Kubernetes pod UID and container id ("<uid>/<container>"); the path elsewhere.
    Pod,
}

impl LabelForm {
    pub fn parse(s: &str) -> Option<LabelForm> {
        match s {
            "none" => Some(LabelForm::None),
            "path" => Some(LabelForm::Path),
            "unit" => Some(LabelForm::Unit),
            "pod" => Some(LabelForm::Pod),
            _ => None,
        }
    }

    /// The label of the cgroup at `path`.
    pub fn label(self, path: &str) -> String {
        match self {
            LabelForm::None | LabelForm::Path => path.to_owned(),
            LabelForm::Unit => unit(path).unwrap_or(path).to_owned(),
            LabelForm::Pod => pod(path).unwrap_or_else(|| path.to_owned()),
        }
    }
}

const UNIT_SUFFIXES: [&str; 7] = [".service", ".scope", ".socket", ".mount", ".swap", ".device", ".target"];

/// systemd's unit of a cgroup path: the first component below the slices that is a unit, or
/// the innermost slice where only slices are.
pub fn unit(path: &str) -> Option<&str> {
    let mut last_slice = None;
    for c in path.split('/').filter(|c| !c.is_empty()) {
        if c.ends_with(".slice") {
            last_slice = Some(c);
        } else if UNIT_SUFFIXES.iter().any(|s| c.ends_with(s)) {
            return Some(c);
        } else {
            break;
        }
    }
    last_slice
}

/// The pod UID and container id of a kubelet cgroup path, either driver:
/// `/kubepods/burstable/pod<uid>/<id>` (cgroupfs) or
/// `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice/cri-containerd-<id>.scope`
/// (systemd). The pod alone ("<uid>") for the pod's own cgroup.
pub fn pod(path: &str) -> Option<String> {
    let comps: Vec<&str> = path.split('/').filter(|c| !c.is_empty()).collect();
    if !comps.first().is_some_and(|c| c.starts_with("kubepods")) {
        return None;
    }
    let (i, uid) = comps.iter().enumerate().find_map(|(i, c)| {
        let name = c.strip_suffix(".slice").unwrap_or(c);
        let at = name.rfind("pod")?;
        let uid = name[at + 3..].replace('_', "-");
        (uid.len() == 36 && uid.chars().all(|ch| ch.is_ascii_hexdigit() || ch == '-')).then_some((i, uid))
    })?;
    match comps.get(i + 1) {
        None => Some(uid),
        Some(c) => {
            let id = c.strip_suffix(".scope").unwrap_or(c);
            let id = id.rsplit('-').next().unwrap_or(id);
            Some(format!("{uid}/{id}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_are_the_first_unit_below_the_slices() {
        assert_eq!(unit("/system.slice/nginx.service"), Some("nginx.service"));
        assert_eq!(unit("/system.slice/nginx.service/worker"), Some("nginx.service"));
        assert_eq!(unit("/user.slice/user-1000.slice/session-3.scope"), Some("session-3.scope"));
        assert_eq!(unit("/user.slice/user-1000.slice"), Some("user-1000.slice"));
        assert_eq!(unit("/tracerd-a"), None);
        assert_eq!(LabelForm::Unit.label("/tracerd-a"), "/tracerd-a", "no unit: the path");
        assert_eq!(unit("/"), None);
    }

    #[test]
    fn pods_come_from_either_kubelet_driver() {
        let uid = "0a1b2c3d-4e5f-6789-abcd-ef0123456789";
        let cid = "f".repeat(64);
        assert_eq!(pod(&format!("/kubepods/burstable/pod{uid}/{cid}")), Some(format!("{uid}/{cid}")));
        assert_eq!(pod(&format!("/kubepods/pod{uid}")), Some(uid.to_owned()));
        let u = uid.replace('-', "_");
        assert_eq!(
            pod(&format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u}.slice/cri-containerd-{cid}.scope"
            )),
            Some(format!("{uid}/{cid}"))
        );
        assert_eq!(pod(&format!("/kubepods.slice/kubepods-pod{u}.slice")), Some(uid.to_owned()));
        assert_eq!(pod("/system.slice/kubelet.service"), None);
        assert_eq!(LabelForm::Pod.label("/system.slice/kubelet.service"), "/system.slice/kubelet.service");
        assert_eq!(pod("/kubepods/burstable/podnot-a-uid/x"), None);
    }
}
