(function () {
  "use strict";
  // The picker's decision: the same rules as ci/index.py's pick(), from this page's table.
  var ASK = 'python -c "import torch; print(torch.__version__, torch.version.cuda)"';

  function num(s) { return parseInt(s, 10); }
  function key(dotted) { return dotted.split(".").map(num); }
  function cmpKey(a, b) {
    for (var i = 0; i < Math.max(a.length, b.length); i++) {
      var d = (a[i] || 0) - (b[i] || 0);
      if (d) return d;
    }
    return 0;
  }
  function sortedUnique(values) {
    var out = [];
    values.forEach(function (v) { if (out.indexOf(v) < 0) out.push(v); });
    return out.sort(function (a, b) { return cmpKey(key(a), key(b)); });
  }

  function pick(rows, project, text) {
    var tokens = String(text).trim().split(/[\s,]+/).filter(function (t) { return t.length > 0; });
    if (tokens.length === 0) return {kind: "empty", reason: "paste what " + ASK + " prints"};
    var m = /^(\d+)\.(\d+)([.0-9a-z]*)(?:\+([.0-9a-z]+))?$/i.exec(tokens[0]);
    if (!m || tokens.length > 2) {
      return {kind: "unparsed", reason: "not a torch version: " + JSON.stringify(tokens.join(" ")) +
              "; paste what " + ASK + " prints, e.g. 2.14.1+cu130 13.0"};
    }
    var version = tokens[0];
    var line = num(m[1]) + "." + num(m[2]);
    var label = (m[4] || "").toLowerCase();
    var cuda = null, c;
    if (label.indexOf("rocm") === 0) {
      return {kind: "rocm", reason: "torch " + version + " is a ROCm build; sageattn3 needs torch built for CUDA (NVIDIA GPUs)"};
    }
    if (tokens.length === 2) {
      if (/^none$/i.test(tokens[1])) {
        cuda = null;
      } else if ((c = /^(\d+)\.(\d+)$/.exec(tokens[1]))) {
        cuda = num(c[1]) + "." + num(c[2]);
      } else {
        return {kind: "unparsed", reason: "not a CUDA version: " + JSON.stringify(tokens[1]) +
                " (torch.version.cuda prints e.g. 13.0, or None for a CPU build)"};
      }
    } else if ((c = /^cu(\d+)(\d)$/.exec(label))) {
      cuda = num(c[1]) + "." + num(c[2]);
    } else if (label !== "cpu") {
      return {kind: "no-cuda", reason: "torch " + version + " does not say which CUDA it was built for; paste what " +
              ASK + " prints"};
    }
    if (cuda === null) {
      return {kind: "cpu", reason: "torch " + version + " is a CPU-only build; sageattn3 needs torch built for CUDA: " +
              "install a CUDA build of torch, then pick again"};
    }
    var major = key(cuda)[0];
    var same = rows.filter(function (r) { return r.line === line; });
    var newer = "";
    var stable = rows.filter(function (r) { return r.stable === "true"; });
    var newest = rows.reduce(function (a, r) { return a === null || cmpKey(key(r.line), key(a)) > 0 ? r.line : a; }, null);
    if (same.length === 0 && stable.length > 0 && cmpKey(key(line), key(newest)) > 0) {
      // A torch line newer than every one built here: the stable-ABI wheels load into it (the
      // import guard lets them), untested; offer the newest such line of torch's CUDA major.
      var majors = stable.filter(function (r) { return key(r.cuda)[0] === major; });
      if (majors.length === 0) {
        return {kind: "no-variant", reason: "no wheels for torch " + line + " built for CUDA " + cuda + "; torch " + line +
                " is newer than every torch line built here, and the stable-ABI wheels that load into it are served " +
                "for CUDA " + sortedUnique(stable.map(function (r) { return r.cuda; })).join(", ")};
      }
      var top = majors.reduce(function (a, r) { return a === null || cmpKey(key(r.line), key(a)) > 0 ? r.line : a; }, null);
      same = majors.filter(function (r) { return r.line === top; });
      newer = "; torch " + line + " is newer than every torch line built here: stable-ABI wheels built against torch " +
              top + ", not tested with torch " + line;
    }
    if (same.length === 0) {
      return {kind: "unknown-line", reason: "no wheels for torch " + line + " on this index; it serves torch " +
              sortedUnique(rows.map(function (r) { return r.line; })).join(", ")};
    }
    var fits = same.filter(function (r) { return key(r.cuda)[0] === major; });
    if (fits.length === 0) {
      return {kind: "no-variant", reason: "no wheels for torch " + line + " built for CUDA " + cuda +
              "; torch " + line + " is served for CUDA " + sortedUnique(same.map(function (r) { return r.cuda; })).join(", ")};
    }
    // Same CUDA first, else the newest not newer than torch's, else the oldest newer one.
    function rank(r) {
      var k = key(r.cuda), older = cmpKey(k, key(cuda)) <= 0, sign = older ? 1 : -1;
      return [r.cuda === cuda ? 1 : 0, older ? 1 : 0, sign * k[0], sign * k[1]];
    }
    var best = fits.reduce(function (a, b) { return cmpKey(rank(b), rank(a)) > 0 ? b : a; });
    return {kind: "ok", page: best.page, url: best.url, links: best.links,
            command: "pip install --no-deps " + project + " --index-url " + best.url,
            reason: "torch " + line + " built for CUDA " + cuda + ": wheels compiled with CUDA " + best.cuda + newer};
  }

  function readTable(doc) {
    var table = doc.querySelector("table[data-project]");
    var rows = Array.prototype.map.call(table.querySelectorAll("tr[data-page]"), function (tr) {
      return {line: tr.getAttribute("data-line"), cuda: tr.getAttribute("data-cuda"), page: tr.getAttribute("data-page"),
              url: tr.getAttribute("data-url"), links: tr.getAttribute("data-links"),
              stable: tr.getAttribute("data-stable")};
    });
    return {project: table.getAttribute("data-project"), rows: rows};
  }

  // What the address's #fragment asks (#2.14.1+cu130%2013.0); a malformed one gets a message
  // instead of the browser's "URI malformed".
  function fragmentText(hash) {
    if (!hash || hash.length < 2) return {text: ""};
    try {
      return {text: decodeURIComponent(hash.slice(1))};
    } catch (e) {
      return {text: "", error: "the address's #fragment " + JSON.stringify(hash.slice(0, 60)) + " is not valid " +
              "percent-encoding (e.g. #2.14.1%2Bcu130%2013.0); paste what " + ASK + " prints into the box instead"};
    }
  }

  function absolute(url, base) { try { return new URL(url, base).href; } catch (e) { return url; } }

  // The table's commands as absolute URLs (the page may be served under any base): each link
  // of a row shows the address it points to, so a copied command works anywhere.
  function absolutize(anchors, base) {
    Array.prototype.forEach.call(anchors, function (a) { a.textContent = absolute(a.getAttribute("href"), base); });
  }

  if (typeof module !== "undefined" && module.exports) {
    module.exports = {pick: pick, readTable: readTable, fragmentText: fragmentText, absolutize: absolutize};
  }
  if (typeof document === "undefined") return;

  var data = readTable(document);
  data.rows.forEach(function (r) { r.url = absolute(r.url, document.baseURI); r.links = absolute(r.links, document.baseURI); });
  absolutize(document.querySelectorAll("table[data-project] tr[data-page] a"), document.baseURI);
  var input = document.getElementById("torch-version");
  var answer = document.getElementById("pick-answer");
  var fragment = fragmentText(location.hash);
  function show() {
    if (fragment.error && input.value === "") {
      answer.textContent = fragment.error;
      return;
    }
    var got = pick(data.rows, data.project, input.value);
    answer.textContent = got.kind === "ok"
      ? got.command + "\n\n(" + got.reason + ")\nor, as a --find-links page:\npip install --no-deps " + data.project +
        " --no-index --find-links " + got.links
      : got.reason;
  }
  input.addEventListener("input", show);
  input.value = fragment.text;
  show();
})();
