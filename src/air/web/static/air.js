// Progressive enhancement only: every page reads completely without this file.
// 1. While runs are active (body[data-live="1"]), the live part of the page is fetched again and swapped in.
// 2. A run's log opens at its end; a running run's log (<pre id="log" data-stream=...>) follows the
//    server's event stream (SSE), staying at its last line unless the reader scrolled up.
// 3. The runs page's filters: what is typed in them is never touched by the refresh (only #live is
//    swapped); a changed status filter applies at once.
(function () {
  "use strict";
  var body = document.body;
  var every = parseInt(body.dataset.refreshMs || "3000", 10);
  var liveId = document.getElementById("live-head") ? "live-head" : "live";

  function refresh(then) {
    fetch(window.location.href, {headers: {"Accept": "text/html"}, credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var fresh = doc.getElementById(liveId), here = document.getElementById(liveId);
        if (fresh && here) { here.innerHTML = fresh.innerHTML; }
        body.dataset.live = doc.body.dataset.live || "0";
        if (then) { then(); }
      })
      .catch(function () { /* a missed refresh is retried by the next tick */ });
  }

  var log = document.getElementById("log");
  var streaming = log && log.dataset.stream;
  // Open at the last line: the newest output (and, for a failed run, its error) is what a reader wants.
  // The log box scrolls inside the page; the page itself is left where it is.
  var following = true;
  function toEnd() { if (log) { log.scrollTop = log.scrollHeight; } }
  if (log) {
    toEnd();
    log.addEventListener("scroll", function () {
      following = log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
    });
  }
  var status = document.querySelector("#filters select[name=status]");
  if (status && status.form) {
    status.addEventListener("change", function () { status.form.submit(); });
  }
  if (body.dataset.live === "1" && document.getElementById(liveId)) {
    var timer = window.setInterval(function () {
      if (body.dataset.live !== "1") { window.clearInterval(timer); return; }
      refresh();
    }, every);
  }

  // Typing in the search box narrows the lines shown at once; Enter still asks the server (which
  // searches further back than the lines on the page).
  var search = document.getElementById("log-search");
  if (log && search) {
    search.addEventListener("input", function () {
      var wanted = search.value.toLowerCase();
      Array.prototype.forEach.call(log.querySelectorAll(".line"), function (line) {
        var hide = wanted && line.textContent.toLowerCase().indexOf(wanted) < 0;
        line.style.display = hide ? "none" : "";
        if (line.nextSibling && line.nextSibling.nodeType === 3) { line.nextSibling.textContent = hide ? "" : "\n"; }
      });
    });
  }

  if (streaming && window.EventSource) {
    var query = (log.dataset.query || "").toLowerCase();
    var source = new EventSource(log.dataset.stream);
    source.addEventListener("lines", function (event) {
      var missing = document.getElementById("log-missing");
      if (missing) { missing.remove(); }
      var atBottom = following || log.scrollTop + log.clientHeight >= log.scrollHeight - 8;
      JSON.parse(event.data).forEach(function (line) {
        if (query && line.text.toLowerCase().indexOf(query) < 0) { return; }
        var span = document.createElement("span");
        span.className = "line" + (line.error ? " error" : "") + (line.signature ? " sig" : "");
        if (line.signature) { span.title = line.signature_label; span.dataset.signature = line.signature; }
        span.textContent = line.text;
        log.appendChild(span);
        log.appendChild(document.createTextNode("\n"));
      });
      if (atBottom) { toEnd(); following = true; }
    });
    // The session's token was revoked while the log streamed: the page goes to the login page.
    source.addEventListener("signed_out", function () {
      source.close();
      window.location.reload();
    });
    source.addEventListener("end", function (event) {
      source.close();
      var status = JSON.parse(event.data).status;
      var over = ["SUCCESS", "FAILED", "CANCELED", "TIMEDOUT", "INTERNAL_ERROR"].indexOf(status) >= 0;
      if (over) { refresh(); return; }
      // A retry started: show the new attempt's log (same node or rank, no attempt pinned).
      var params = new URLSearchParams(window.location.search);
      params.delete("attempt");
      window.location.search = params.toString();
    });
  }
})();
