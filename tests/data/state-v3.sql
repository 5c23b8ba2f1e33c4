-- written by commctx schema 3 (this repository before node memberships)
PRAGMA user_version = 3;
PRAGMA foreign_keys=OFF;
BEGIN TRANSACTION;
CREATE TABLE writer (id INTEGER PRIMARY KEY CHECK (id = 1), epoch INTEGER NOT NULL);
INSERT INTO writer VALUES(1,1);
CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY, state TEXT NOT NULL, generation INTEGER NOT NULL,
        reason TEXT NOT NULL, spec TEXT NOT NULL, world TEXT, secret TEXT NOT NULL DEFAULT '');
INSERT INTO jobs VALUES('pair','formed',1,'','{"world_size":2}','{"nodes":[{"node_key":"n0","address":"10.0.1.1","members":["00000000000000b1"]},{"node_key":"n1","address":"10.0.1.2","members":["00000000000000b2"]}],"roles":[],"master_addr":"10.0.1.1","master_port":29500}','');
INSERT INTO jobs VALUES('waiting','forming',0,'','{"world_size":2}',NULL,'');
CREATE TABLE members (
        job_id TEXT NOT NULL, member_id TEXT NOT NULL, seq INTEGER NOT NULL,
        node_key TEXT NOT NULL, address TEXT NOT NULL, port INTEGER NOT NULL,
        local_rank INTEGER, node_rank INTEGER, role TEXT NOT NULL,
        secret TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (job_id, member_id));
INSERT INTO members VALUES('pair','00000000000000b2',2,'n1','10.0.1.2',29501,NULL,NULL,'','d2f9fa9d99bb30b2b67fc6b0ea2694f345c0961596e0fd82561010b4f7570c2d');
INSERT INTO members VALUES('pair','00000000000000b1',1,'n0','10.0.1.1',0,NULL,NULL,'','d2f9fa9d99bb30b2b67fc6b0ea2694f345c0961596e0fd82561010b4f7570c2d');
INSERT INTO members VALUES('waiting','00000000000000b3',3,'n9','10.0.1.3',29502,NULL,NULL,'','d2f9fa9d99bb30b2b67fc6b0ea2694f345c0961596e0fd82561010b4f7570c2d');
COMMIT;
